//! The replay service: actors on several hosts, a learner that checks every row.

use super::*;

/// A row of actor `actor`, number `seq` (from 1): `key = [actor, seq]`, `obs[j] = actor * 1e6 +
/// seq * 100 + j`, `WIDTH` values.
pub(crate) fn actor_rows(actor: i64, first_seq: i64, n: usize) -> anyhow::Result<TensorDict> {
    actor_rows_of_width(actor, first_seq, n, WIDTH)
}

/// [`actor_rows`] with `width` values of `obs` (the benchmarks' rows: [`BENCH_WIDTH`]).
pub(crate) fn actor_rows_of_width(actor: i64, first_seq: i64, n: usize, width: usize) -> anyhow::Result<TensorDict> {
    let mut td = TensorDict::new([n]);
    let key: Vec<i64> = (0..n as i64).flat_map(|i| [actor, first_seq + i]).collect();
    let obs: Vec<f64> = (0..n as i64)
        .flat_map(|i| (0..width as i64).map(move |j| (actor * 1_000_000 + (first_seq + i) * 100 + j) as f64))
        .collect();
    td.set("key", Tensor::from_slice(&key, [n, 2])?)?;
    td.set("obs", Tensor::from_slice(&obs, [n, width])?)?;
    Ok(td)
}

/// The width of `obs` in the service's storage (the rows an actor must write).
pub(crate) fn storage_width(buffer: &RemoteBuffer) -> anyhow::Result<usize> {
    let storage = buffer.info().storage.as_ref().context("the service has no storage yet")?;
    let tensors = storage.schema.tensors();
    let (_, obs) = tensors.iter().find(|(key, _)| key.parts() == ["obs"]).context("the storage has no `obs`")?;
    obs.shape.get(1).copied().context("`obs` has no row dim")
}

/// A client of the replay service: `shared-fs` for a folder on a network filesystem (rows
/// written with pwrite and fdatasync before their commit, read with O_DIRECT from files opened
/// afresh), `buffered` the same reading through the page cache, `mapped` for the default (writes and reads through
/// the mapping, right on one node only).
pub(crate) fn replay_client(
    (endpoint, options): &(Endpoint, ClientOptions),
    mode: &str,
) -> anyhow::Result<RemoteBuffer> {
    let buffer = RemoteBuffer::connect_to(endpoint, options).with_context(|| format!("connecting to {endpoint}"))?;
    let engine = || tensordict_aio::Engine::new().context("an I/O engine");
    Ok(match mode {
        "shared-fs" => buffer.on_shared_filesystem(engine()?),
        "buffered" => buffer.on_shared_filesystem(engine()?).with_read_mode(ReadMode::Buffered),
        "mapped" => buffer.by_value(false),
        // Rows cross the connection (what a client on another node does by default; the
        // hosts here share one kernel and /dev/shm, so they would count as one node).
        "by-value" => buffer.by_value(true),
        other => bail!("unknown client mode `{other}` (shared-fs, buffered, mapped or by-value)"),
    })
}

pub(crate) fn replay_actor(buffer: &RemoteBuffer, dir: &Path, actor: i64) -> anyhow::Result<()> {
    for phase in 1..=2i64 {
        let first = (phase - 1) * ACTOR_BATCH as i64 + 1;
        let rows = buffer.extend(&actor_rows(actor, first, ACTOR_BATCH)?)?;
        println!(
            "{}: actor {actor}: phase {phase}: wrote seq {first}..={} into rows {rows:?}",
            host(),
            first + ACTOR_BATCH as i64 - 1
        );
        put(&dir.join(format!("actor-{actor}-{phase}")), "done")?;
        if phase == 1 {
            wait_for(&dir.join("learner-1"), WAIT)?;
        }
    }
    Ok(())
}

pub(crate) fn replay_learner(buffer: &RemoteBuffer, dir: &Path, actors: &[i64], storage: &Path) -> anyhow::Result<()> {
    let mut failures = Vec::new();
    for phase in 1..=2i64 {
        for actor in actors {
            wait_for(&dir.join(format!("actor-{actor}-{phase}")), WAIT)?;
        }
        let written = phase * ACTOR_BATCH as i64;
        let (batch, info) = buffer.sample(LEARNER_BATCH, Some(Duration::from_secs(20)))?;
        let indices: Vec<usize> = info.indices.clone();
        let (whole, bad) = check_rows_of(&batch, actors, written)?;
        let mut from: Vec<i64> =
            batch.get_tensor("key")?.contiguous()?.to_vec::<i64>()?.into_iter().step_by(2).collect();
        from.sort_unstable();
        from.dedup();
        println!(
            "{}: phase {phase}: sampled {LEARNER_BATCH} rows (storage rows {indices:?}) of {} written by actors {actors:?}: {whole} whole, from actors {from:?}",
            host(),
            written * actors.len() as i64
        );
        if !bad.is_empty() {
            // The same rows through a mapping made now: tells rows that never reached the
            // shared file from rows this process's older mapping does not show.
            let fresh = TensorDict::load_memmap(storage, Access::ReadOnly)
                .with_context(|| format!("opening {} afresh", storage.display()))?;
            let rows: Vec<i64> = indices.iter().map(|&i| i as i64).collect();
            let (fresh_whole, _) = check_rows_of(&fresh.index(Index::List(rows))?, actors, written)?;
            println!(
                "{}: phase {phase}: the same rows through a fresh open of {}: {fresh_whole} whole",
                host(),
                storage.display()
            );
            let zeros = bad.iter().filter(|(_, what)| what == "all zeros").count();
            let mut rows: Vec<usize> = bad.iter().map(|&(i, _)| indices[i]).collect();
            rows.sort_unstable();
            rows.dedup();
            let first = bad.first().map(|(i, what)| format!("batch row {i}: {what}")).unwrap_or_default();
            failures.push(format!(
                "phase {phase}: {} of {LEARNER_BATCH} sampled rows not whole ({zeros} all zeros, first {first}), storage rows {rows:?}; {fresh_whole} whole through a fresh open",
                bad.len(),
            ));
        }
        if phase == 1 {
            put(&dir.join("learner-1"), "done")?;
        }
    }
    ensure!(failures.is_empty(), "{}", failures.join(" | "));
    Ok(())
}

/// Checks each sampled row: its key is `[actor, seq]` with `1 <= seq <= written` and its `obs`
/// is that row's. Returns how many are whole, and the batch position and what is wrong of the
/// others.
pub(crate) fn check_rows(
    batch: &TensorDict,
    actor: i64,
    written: i64,
) -> anyhow::Result<(usize, Vec<(usize, String)>)> {
    check_rows_of(batch, &[actor], written)
}

/// [`check_rows`] for rows of any of `actors`, each of which wrote `written` rows.
pub(crate) fn check_rows_of(
    batch: &TensorDict,
    actors: &[i64],
    written: i64,
) -> anyhow::Result<(usize, Vec<(usize, String)>)> {
    let key = batch.get_tensor("key")?.contiguous()?.to_vec::<i64>()?;
    let obs_tensor = batch.get_tensor("obs")?;
    let width = obs_tensor.dims().get(1).copied().unwrap_or(0);
    let obs = obs_tensor.contiguous()?.to_vec::<f64>()?;
    let n = key.len() / 2;
    let mut bad = Vec::new();
    for i in 0..n {
        let (a, seq) = (key[2 * i], key[2 * i + 1]);
        let row = &obs[i * width..(i + 1) * width];
        if !actors.contains(&a) || !(1..=written).contains(&seq) {
            let zeros = a == 0 && seq == 0 && row.iter().all(|&v| v == 0.0);
            bad.push((i, if zeros { "all zeros".to_owned() } else { format!("key [{a}, {seq}]") }));
            continue;
        }
        let want: Vec<f64> = (0..width as i64).map(|j| (a * 1_000_000 + seq * 100 + j) as f64).collect();
        if row != want.as_slice() {
            bad.push((i, format!("key [{a}, {seq}] with obs {row:?}")));
        }
    }
    Ok((n - bad.len(), bad))
}
