//! A client of the shared folder while its file server stops and starts.

use super::*;

/// Rows of the dict the file-server test loads.
pub(crate) const FS_ROWS: usize = 256;

pub(crate) fn fs_dict() -> anyhow::Result<TensorDict> {
    let obs: Vec<f32> = (0..FS_ROWS * WIDTH).map(|i| i as f32 * 0.25).collect();
    let mut td = TensorDict::new([FS_ROWS]);
    td.set("obs", Tensor::from_slice(&obs, [FS_ROWS, WIDTH])?)?;
    Ok(td)
}

pub(crate) fn fs_make(dir: &Path) -> anyhow::Result<()> {
    let folder = dir.join("dict");
    let td = fs_dict()?.memmap(&folder)?;
    td.flush()?;
    println!("{}: made {} ({FS_ROWS} rows)", host(), folder.display());
    Ok(())
}

/// The most one load may take: past it, the load counts as hung.
pub(crate) const FS_OP_LIMIT: Duration = Duration::from_secs(20);

pub(crate) fn fs_client(dir: &Path, control: &Path) -> anyhow::Result<()> {
    let folder = dir.join("dict");
    let want = fs_dict()?.get_tensor("obs")?.to_vec::<f32>()?;
    // up -> down -> up-again
    let mut state = "starting";
    let (mut oks, mut errors, mut longest) = (0usize, 0usize, Duration::ZERO);
    let mut first_error = String::new();
    let mut down_since = None;
    loop {
        let (tx, rx) = mpsc::channel();
        let (f, w) = (folder.clone(), want.clone());
        let start = Instant::now();
        std::thread::spawn(move || {
            let result = (|| -> anyhow::Result<()> {
                // Read, not mapped: a page of a mapping that the stopped server cannot fill
                // would kill this client with SIGBUS instead of returning an error.
                let td = TensorDict::read_memmap(&f)?;
                let got = td.get_tensor("obs")?.to_vec::<f32>()?;
                ensure!(got == w, "{} holds other values than were written", f.display());
                Ok(())
            })();
            let _ = tx.send(result);
        });
        let result = match rx.recv_timeout(FS_OP_LIMIT) {
            Ok(result) => result,
            Err(_) => bail!("a load of {} did not return within {FS_OP_LIMIT:?} (state {state})", folder.display()),
        };
        longest = longest.max(start.elapsed());
        let next = match (&result, state) {
            (Ok(()), "starting") => "up",
            (Err(_), "starting") => bail!("the first load failed: {:#}", result.unwrap_err()),
            (Err(_), "up") => "down",
            (Ok(()), "down") => "up-again",
            _ => state,
        };
        match result {
            Ok(()) => oks += 1,
            Err(e) => {
                errors += 1;
                if first_error.is_empty() {
                    first_error = format!("{e:#}");
                }
            }
        }
        if next != state {
            println!("{}: {state} -> {next} after {oks} good loads and {errors} errors", host());
            if next == "down" {
                down_since = Some(Instant::now());
            }
            if next == "up-again" {
                let down = down_since.map(|t| t.elapsed().as_secs_f64()).unwrap_or_default();
                println!("{}: loads failed for {down:.1} s, the first error: {first_error}", host());
            }
            state = next;
            put(&control.join("state"), state)?;
        }
        if control.join("stop").exists() {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    println!("{}: {oks} good loads, {errors} errors, the longest load {longest:?}", host());
    ensure!(state == "up-again", "stopped in state {state}, not up-again");
    Ok(())
}
