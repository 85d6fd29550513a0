//! The remote update: a worker on another host writes rows of a folder on the shared
//! filesystem and publishes; the owner reads exactly the new rows.

use super::*;

/// The value the worker writes at (row, column).
pub(crate) fn updated_value(row: i64, col: usize) -> f32 {
    (row * 100) as f32 + col as f32 + 0.5
}

pub(crate) fn update_owner(dir: &Path) -> anyhow::Result<()> {
    let folder = dir.join("dict");
    let mut schema = TensorDict::new([1]);
    schema.set("obs", Tensor::zeros([1, WIDTH], DType::F32, &Location::Heap)?)?;
    schema.set(["meta", "step"], Tensor::zeros([1], DType::I64, &Location::Heap)?)?;
    let td = schema.memmap_like(&folder, Some(UPDATE_ROWS))?;
    let reference = td.to_ref()?;
    put(&dir.join("request.json"), &serde_json::to_string(&reference)?)?;
    println!(
        "{}: made {} ({UPDATE_ROWS} rows) at generation {}",
        host(),
        folder.display(),
        reference.generation.counter
    );

    let reply: TensorDictRef = serde_json::from_str(&wait_for(&dir.join("reply.json"), WAIT)?)?;
    ensure!(
        reply.generation.counter == reference.generation.counter + 1,
        "the worker's reference is at generation {}, expected {}",
        reply.generation.counter,
        reference.generation.counter + 1
    );
    // The reference taken before the update must now be refused.
    match reference.open(Access::ReadOnly) {
        Ok(_) => bail!("the reference of the old generation still opens after the worker published"),
        Err(e) => println!("{}: the old reference is refused: {e}", host()),
    }
    // This process's first mapping: on a network filesystem it need not show another node's
    // writes until the file is opened again. Only reported.
    let stale = td.get_tensor("obs")?.select(0, UPDATED[0])?.to_vec::<f32>()?;
    println!("{}: the mapping made before the update shows row {}: {stale:?}", host(), UPDATED[0]);

    // Reopened at the new generation, and read past this node's page cache (DESIGN.md, rule 3).
    let engine = tensordict_aio::Engine::new().context("an I/O engine")?;
    check_updated(&reply.read_direct(&engine).context("reading the worker's reference")?)?;
    println!(
        "{}: reopened, read with O_DIRECT: rows {UPDATED:?} hold the worker's values, the other rows are zero",
        host()
    );
    Ok(())
}

pub(crate) fn check_updated(td: &TensorDict) -> anyhow::Result<()> {
    let obs = td.get_tensor("obs")?.to_vec::<f32>()?;
    let step = td.get_tensor(["meta", "step"])?.to_vec::<i64>()?;
    ensure!(obs.len() == UPDATE_ROWS * WIDTH && step.len() == UPDATE_ROWS, "the dict has the wrong shape");
    for row in 0..UPDATE_ROWS as i64 {
        let written = UPDATED.contains(&row);
        for col in 0..WIDTH {
            let want = if written { updated_value(row, col) } else { 0.0 };
            let got = obs[row as usize * WIDTH + col];
            ensure!(got == want, "obs[{row}, {col}] is {got}, expected {want}");
        }
        let want = if written { row + 1000 } else { 0 };
        ensure!(step[row as usize] == want, "meta.step[{row}] is {}, expected {want}", step[row as usize]);
    }
    Ok(())
}

pub(crate) fn update_worker(dir: &Path) -> anyhow::Result<()> {
    let reference: TensorDictRef = serde_json::from_str(&wait_for(&dir.join("request.json"), WAIT)?)?;
    let mut td = reference.open(Access::ReadWrite).context("opening the owner's reference")?;
    let n = UPDATED.len();
    let obs: Vec<f32> = UPDATED.iter().flat_map(|&r| (0..WIDTH).map(move |c| updated_value(r, c))).collect();
    let step: Vec<i64> = UPDATED.iter().map(|&r| r + 1000).collect();
    let mut rows = TensorDict::new([n]);
    rows.set("obs", Tensor::from_slice(&obs, [n, WIDTH])?)?;
    rows.set(["meta", "step"], Tensor::from_slice(&step, [n])?)?;
    td.set_at(Index::List(UPDATED.to_vec()), &rows)?;
    let generation = td.publish()?;
    let reply = td.to_ref()?;
    put(&dir.join("reply.json"), &serde_json::to_string(&reply)?)?;
    println!("{}: wrote rows {UPDATED:?}, published generation {}", host(), generation.counter);
    Ok(())
}
