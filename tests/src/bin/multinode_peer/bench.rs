//! Benchmarks: remote updates, samples and extends across hosts.

use super::*;

pub(crate) fn percentile(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i].as_secs_f64() * 1e6
}

/// The value of column `col` of row `row` in round `round` of the update benchmark.
pub(crate) fn bench_value(round: usize, row: i64, col: usize) -> f32 {
    (round * 1000) as f32 + (row * WIDTH as i64) as f32 + col as f32
}

pub(crate) fn bench_update_owner(dir: &Path, port: u16, rounds: usize, mode: &str) -> anyhow::Result<()> {
    let patience = match mode {
        "strict" => Duration::ZERO,
        "wait" => Duration::from_secs(2),
        other => bail!("unknown reopen mode `{other}` (strict or wait)"),
    };
    let folder = dir.join("bench-dict");
    let mut schema = TensorDict::new([1]);
    schema.set("obs", Tensor::zeros([1, WIDTH], DType::F32, &Location::Heap)?)?;
    let td = schema.memmap_like(&folder, Some(UPDATE_ROWS))?;
    let listener = TcpListener::bind(("0.0.0.0", port)).with_context(|| format!("listening on port {port}"))?;
    let (stream, peer) = listener.accept()?;
    stream.set_nodelay(true)?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut writer = stream;
    writeln!(writer, "{}", serde_json::to_string(&td.to_ref()?)?)?;
    let mut line = String::new();
    let engine = tensordict_aio::Engine::new().context("an I/O engine")?;
    let mut stale_mappings = 0;
    for round in 0..rounds {
        line.clear();
        ensure!(reader.read_line(&mut line)? > 0, "{peer} hung up at round {round}");
        let reference: TensorDictRef = serde_json::from_str(&line)?;
        let start = Instant::now();
        let mut retries = 0;
        let read = loop {
            match reference.read_direct(&engine) {
                Ok(read) => break read,
                Err(e) if start.elapsed() < patience => {
                    if retries == 0 {
                        println!("{}: round {round}: reopen refused, trying again: {e}", host());
                    }
                    retries += 1;
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(e) => return Err(e).with_context(|| format!("round {round}: reopening")),
            }
        };
        // The rows as read past this node's page cache (`read_direct`), which must be right,
        // and through a fresh mapping, which on a FUSE mount that keeps cached pages across
        // opens can still show what this node cached before: counted, not trusted.
        // (The benchmark, `wait`, times the reads alone.)
        let rows = read.get_tensor("obs")?.to_vec::<f32>()?;
        let mapped = match mode {
            "strict" => Some(reference.open(Access::ReadOnly)?.get_tensor("obs")?.to_vec::<f32>()?),
            _ => None,
        };
        let mut mapping_stale = false;
        for &row in &UPDATED {
            for col in 0..WIDTH {
                let at = row as usize * WIDTH + col;
                let (got, want) = (rows[at], bench_value(round, row, col));
                ensure!(got == want, "round {round}: obs[{row}, {col}] is {got}, expected {want}");
                mapping_stale |= mapped.as_ref().is_some_and(|m| m[at] != want);
            }
        }
        stale_mappings += usize::from(mapping_stale);
        writeln!(writer, "ok {retries}")?;
    }
    println!(
        "{}: {rounds} updates from {peer} reopened and checked with O_DIRECT reads; the fresh mapping was stale in {stale_mappings}",
        host()
    );
    Ok(())
}

/// Connects to `addr` (retrying until it listens, for up to `WAIT`): the line reader and the
/// writer of the connection.
pub(crate) fn connect_lines(addr: &str) -> anyhow::Result<(BufReader<TcpStream>, TcpStream)> {
    let start = Instant::now();
    let stream = loop {
        match TcpStream::connect(addr) {
            Ok(s) => break s,
            Err(_) if start.elapsed() < WAIT => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => return Err(e).with_context(|| format!("connecting to {addr}")),
        }
    };
    stream.set_nodelay(true)?;
    Ok((BufReader::new(stream.try_clone()?), stream))
}

pub(crate) fn bench_update_worker(addr: &str, rounds: usize, label: &str) -> anyhow::Result<()> {
    let (mut reader, mut writer) = connect_lines(addr)?;
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let reference: TensorDictRef = serde_json::from_str(&line)?;
    let mut td = reference.open(Access::ReadWrite).context("opening the owner's reference")?;
    let mut times = Vec::with_capacity(rounds);
    let mut refused = 0;
    for round in 0..rounds {
        let t0 = Instant::now();
        let obs: Vec<f32> = UPDATED.iter().flat_map(|&r| (0..WIDTH).map(move |c| bench_value(round, r, c))).collect();
        let mut rows = TensorDict::new([UPDATED.len()]);
        rows.set("obs", Tensor::from_slice(&obs, [UPDATED.len(), WIDTH])?)?;
        td.set_at(Index::List(UPDATED.to_vec()), &rows)?;
        td.flush()?;
        td.publish()?;
        writeln!(writer, "{}", serde_json::to_string(&td.to_ref()?)?)?;
        line.clear();
        ensure!(reader.read_line(&mut line)? > 0, "round {round}: the owner hung up");
        let retries: usize = match line.trim().strip_prefix("ok ") {
            Some(n) => n.parse()?,
            None => bail!("round {round}: the owner answered {line:?}"),
        };
        refused += usize::from(retries > 0);
        times.push(t0.elapsed());
    }
    times.sort_unstable();
    let json = serde_json::json!({
        "bench": "remote-update",
        "fs": label,
        "rounds": rounds,
        "p50_us": percentile(&times, 0.5).round(),
        "p99_us": percentile(&times, 0.99).round(),
        "max_us": percentile(&times, 1.0).round(),
        "rounds_with_a_refused_reopen": refused,
    });
    println!("{json}");
    Ok(())
}

pub(crate) fn bench_sample(
    buffer: &RemoteBuffer,
    mode: &str,
    seconds: f64,
    batch: usize,
    label: &str,
) -> anyhow::Result<()> {
    let len = buffer.stats()?.len;
    let limit = Duration::from_secs_f64(seconds);
    let start = Instant::now();
    let mut batches = 0u64;
    let mut checked = 0u64;
    while start.elapsed() < limit {
        let (td, _) = buffer.sample(batch, Some(Duration::from_secs(10)))?;
        // One batch in 16 is checked whole, inside the clock (a check costs less than a gather).
        if batches.is_multiple_of(16) {
            let (_, bad) = check_rows(&td, 1, len as i64)?;
            ensure!(bad.is_empty(), "a sampled batch has {} rows not whole: {:?}", bad.len(), bad.first());
            checked += 1;
        }
        batches += 1;
    }
    let elapsed = start.elapsed().as_secs_f64();
    let json = serde_json::json!({
        "bench": "sample-gather",
        "fs": label,
        "mode": mode,
        "rows_in_buffer": len,
        "batch": batch,
        "batches": batches,
        "batches_checked": checked,
        "seconds": (elapsed * 100.0).round() / 100.0,
        "rows_per_s": (batches as f64 * batch as f64 / elapsed).round(),
    });
    println!("{json}");
    Ok(())
}

pub(crate) fn bench_extend(
    buffer: &RemoteBuffer,
    mode: &str,
    seconds: f64,
    batch: usize,
    label: &str,
    actor: i64,
) -> anyhow::Result<()> {
    let len = buffer.stats()?.len as i64;
    let width = storage_width(buffer)?;
    ensure!(len as usize >= batch, "the buffer holds {len} rows, fewer than a batch of {batch}");
    let limit = Duration::from_secs_f64(seconds);
    let start = Instant::now();
    let mut times = Vec::new();
    // Rows of actor 1 with sequence numbers already in the buffer, so samples stay checkable
    // (another actor's rows are checked as actor 1's by the learner's bench: only one writes
    // while it samples).
    let mut seq = 1;
    while start.elapsed() < limit {
        if seq + batch as i64 - 1 > len {
            seq = 1;
        }
        let rows = actor_rows_of_width(actor, seq, batch, width)?;
        let t0 = Instant::now();
        buffer.extend_within(&rows, Some(Duration::from_secs(10)))?;
        times.push(t0.elapsed());
        seq += batch as i64;
    }
    let elapsed = start.elapsed().as_secs_f64();
    times.sort_unstable();
    let json = serde_json::json!({
        "bench": "extend",
        "fs": label,
        "mode": mode,
        "actor": actor,
        "batch": batch,
        "extends": times.len(),
        "p50_us": percentile(&times, 0.5).round(),
        "p99_us": percentile(&times, 0.99).round(),
        "rows_per_s": (times.len() as f64 * batch as f64 / elapsed).round(),
    });
    println!("{json}");
    Ok(())
}

/// The receiving side of the network's bandwidth: one connection read to its end.
pub(crate) fn net_sink(port: u16) -> anyhow::Result<()> {
    let listener = TcpListener::bind(("0.0.0.0", port)).with_context(|| format!("listening on port {port}"))?;
    let (mut stream, _) = listener.accept()?;
    let mut buf = vec![0u8; 1 << 20];
    let mut bytes = 0u64;
    let mut start = None;
    loop {
        let n = std::io::Read::read(&mut stream, &mut buf)?;
        if n == 0 {
            break;
        }
        start.get_or_insert_with(Instant::now);
        bytes += n as u64;
    }
    let seconds = start.map_or(0.0, |s| s.elapsed().as_secs_f64());
    ensure!(seconds > 0.0, "nothing was received");
    let json = serde_json::json!({
        "bench": "tcp",
        "bytes": bytes,
        "seconds": (seconds * 100.0).round() / 100.0,
        "bytes_per_s": (bytes as f64 / seconds).round(),
    });
    println!("{json}");
    Ok(())
}

/// The sending side: zeros for `seconds`, in 1 MiB writes.
pub(crate) fn net_source(addr: &str, seconds: f64) -> anyhow::Result<()> {
    let (_, mut stream) = connect_lines(addr)?;
    let buf = vec![0u8; 1 << 20];
    let start = Instant::now();
    while start.elapsed().as_secs_f64() < seconds {
        stream.write_all(&buf)?;
    }
    Ok(())
}
