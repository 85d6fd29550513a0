//! Failures of the replay service's clients: wrong tokens, killed reservers and leasers.

use super::*;

pub(crate) fn replay_refused(endpoint: &str) -> anyhow::Result<()> {
    let endpoint: Endpoint = endpoint.parse()?;
    let token = Token::from_bytes(b"not-the-token-of-this-service".to_vec())?;
    let options = ClientOptions::default().token(token).connect_timeout(Duration::from_secs(10));
    match RemoteBuffer::connect_to(&endpoint, &options) {
        Ok(buffer) => match buffer.stats() {
            Ok(stats) => bail!("a replay client with a wrong token was served (stats {stats:?})"),
            Err(e) => println!("{}: wrong token refused at the first call: {e}", host()),
        },
        Err(e) => println!("{}: wrong token refused: {e}", host()),
    }
    Ok(())
}

pub(crate) fn replay_fill(
    buffer: &RemoteBuffer,
    actor: i64,
    rows: usize,
    batch: usize,
    width: usize,
) -> anyhow::Result<()> {
    ensure!(batch > 0, "a batch of 0 rows");
    let start = Instant::now();
    let mut seq = 1;
    while seq <= rows as i64 {
        let n = batch.min(rows + 1 - seq as usize);
        buffer
            .extend(&actor_rows_of_width(actor, seq, n, width)?)
            .with_context(|| format!("extending rows from seq {seq}"))?;
        seq += n as i64;
    }
    println!("{}: wrote {rows} rows of actor {actor} in {:.2} s", host(), start.elapsed().as_secs_f64());
    Ok(())
}

/// What a process that blocks tells the harness: its pid (to kill it) and its rows.
#[derive(serde::Serialize, serde::Deserialize)]
pub(crate) struct Ready {
    pid: u32,
    rows: Vec<u64>,
}

/// Blocks until the process is killed.
pub(crate) fn block() -> ! {
    loop {
        std::thread::park();
    }
}

pub(crate) fn replay_reserver(buffer: &RemoteBuffer, ready: &Path) -> anyhow::Result<()> {
    let reservation = buffer.reserve(8, Some(Duration::from_secs(20))).context("reserving 8 rows")?;
    let rows: Vec<i64> = reservation.rows().iter().map(|&r| r as i64).collect();
    // Half of the rows written, as an actor killed in the middle of its write leaves them: with
    // the storage's files as the client writes them.
    let reference = buffer.info().storage.clone().context("the service has no storage")?;
    let tensordict_rpc::RefLocation::Folder { path } = &reference.location else {
        bail!("the storage is not a folder")
    };
    let files = RowFiles::new(path, &reference.schema)?;
    let half = &rows[..rows.len() / 2];
    let half_rows: Vec<usize> = half.iter().map(|&r| r as usize).collect();
    files
        .write(&tensordict_aio::Engine::new()?, &files.row_index(&half_rows)?, &actor_rows(9, 900, half.len())?)
        .context("writing half of the reserved rows")?;
    let open = buffer.stats()?.open_reservations;
    ensure!(open == 1, "{open} open reservations after reserving, expected 1");
    put(
        ready,
        &serde_json::to_string(&Ready { pid: std::process::id(), rows: rows.iter().map(|&r| r as u64).collect() })?,
    )?;
    println!("{}: reserved rows {rows:?}, wrote {half:?}, blocking until killed", host());
    std::mem::forget(reservation);
    block()
}

/// Polls `check` every 50 ms until it is true, for at most `limit`.
pub(crate) fn eventually(
    what: &str,
    limit: Duration,
    mut check: impl FnMut() -> anyhow::Result<bool>,
) -> anyhow::Result<Duration> {
    let start = Instant::now();
    while !check()? {
        ensure!(start.elapsed() < limit, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(start.elapsed())
}

pub(crate) fn replay_after_death(buffer: &RemoteBuffer, ready: &Path, actor: i64, rows: i64) -> anyhow::Result<()> {
    let ready: Ready = serde_json::from_str(&wait_for(ready, WAIT)?)?;
    let took =
        eventually("the dead reserver's session released (open_reservations 0)", Duration::from_secs(30), || {
            Ok(buffer.stats()?.open_reservations == 0)
        })?;
    let stats = buffer.stats()?;
    println!(
        "{}: the reservation of rows {:?} was gone {took:?} after this learner began to watch: {} open reservations, {} sessions",
        host(),
        ready.rows,
        stats.open_reservations,
        stats.sessions
    );
    let mut drawn = 0;
    for round in 0..100 {
        let (batch, info) = buffer.sample(64, Some(Duration::from_secs(10)))?;
        if let Some(row) = info.indices.iter().find(|&&i| ready.rows.contains(&(i as u64))) {
            bail!("round {round}: sampled row {row}, reserved by the killed actor");
        }
        let (_, bad) = check_rows(&batch, actor, rows)?;
        if let Some((i, what)) = bad.first() {
            bail!("round {round}: sampled storage row {} is not whole: {what}", info.indices[*i]);
        }
        drawn += info.indices.len();
    }
    println!("{}: {drawn} sampled rows, none of the killed actor's, every one whole", host());
    Ok(())
}

pub(crate) fn replay_leaser((endpoint, options): &(Endpoint, ClientOptions), ready: &Path) -> anyhow::Result<()> {
    let raw: BlockingClient<ReplayServiceClient> = BlockingClient::connect(endpoint, options)?;
    let sampled = raw.invoke(async |c, ctx| c.sample(ctx, 8, Some(Duration::from_secs(10)), Vec::new()).await)?;
    put(ready, &serde_json::to_string(&Ready { pid: std::process::id(), rows: sampled.indices.clone() })?)?;
    println!("{}: leased rows {:?} (lease {}), blocking until killed", host(), sampled.indices, sampled.lease);
    std::mem::forget(raw);
    block()
}

pub(crate) fn replay_extend_over(
    options: &(Endpoint, ClientOptions),
    ready: &Path,
    blocked: &Path,
    actor: i64,
    rows: usize,
) -> anyhow::Result<()> {
    let buffer = replay_client(options, "shared-fs")?;
    let ready: Ready = serde_json::from_str(&wait_for(ready, WAIT)?)?;
    let leases = buffer.stats()?.open_leases;
    ensure!(leases == 1, "{leases} open leases with the leaser alive, expected 1");
    let (tx, rx) = mpsc::channel();
    let writer = replay_client(options, "shared-fs")?;
    std::thread::spawn(move || {
        let _ = tx.send(writer.extend(&actor_rows(actor, 1, rows)?));
        anyhow::Ok(())
    });
    // The write covers every row, the leased ones too: it must wait for them.
    match rx.recv_timeout(Duration::from_secs(2)) {
        Ok(result) => bail!("the extend over leased rows {:?} did not wait for the lease: {result:?}", ready.rows),
        Err(mpsc::RecvTimeoutError::Disconnected) => bail!("the writer thread failed"),
        Err(mpsc::RecvTimeoutError::Timeout) => {}
    }
    println!("{}: the extend over leased rows {:?} waits", host(), ready.rows);
    put(blocked, "waiting")?;
    let start = Instant::now();
    let written = rx
        .recv_timeout(Duration::from_secs(40))
        .map_err(|_| anyhow::anyhow!("the extend did not complete within 40 s of waiting for the killed leaser"))?
        .context("the extend over the killed leaser's rows")?;
    let stats = buffer.stats()?;
    ensure!(stats.open_leases == 0, "{} open leases after the extend", stats.open_leases);
    println!(
        "{}: the extend of {} rows completed {:.2} s after the leaser was to be killed; open_leases 0",
        host(),
        written.len(),
        start.elapsed().as_secs_f64()
    );
    let (batch, info) = buffer.sample(64, Some(Duration::from_secs(10)))?;
    let (_, bad) = check_rows(&batch, actor, rows as i64)?;
    if let Some((i, what)) = bad.first() {
        bail!("sampled storage row {} after the extend is not the new one: {what}", info.indices[*i]);
    }
    println!("{}: 64 sampled rows are all the new actor's", host());
    Ok(())
}

/// Rows per extend of [`replay_stream_actor`]: of 696-byte rows, about two frames' worth, so
/// that a kill lands in the middle of sending them as often as not.
const STREAM_ROWS: usize = 2_000;

/// An actor by value that extends [`STREAM_ROWS`] rows of actor `actor` again and again. After
/// its first extend it writes `ready` (its pid, to be killed mid-stream). When the service dies
/// instead, its next extend must fail within `SERVICE_DEATH_LIMIT`: it says so and exits 0.
pub(crate) fn replay_stream_actor(buffer: &RemoteBuffer, ready: &Path, actor: i64) -> anyhow::Result<()> {
    let width = storage_width(buffer)?;
    let mut seq = 1;
    let mut first = true;
    loop {
        let rows = actor_rows_of_width(actor, seq, STREAM_ROWS, width)?;
        let started = Instant::now();
        match buffer.extend(&rows) {
            Ok(_) => seq += STREAM_ROWS as i64,
            Err(e) => return service_died("actor", started, &anyhow::Error::new(e)),
        }
        if first {
            put(ready, &serde_json::to_string(&Ready { pid: std::process::id(), rows: Vec::new() })?)?;
            println!("{}: actor {actor} by value: first {STREAM_ROWS} rows written, extending on", host());
            first = false;
        }
    }
}

/// A learner by value that samples 256 rows again and again, every row checked whole (of any
/// actor). After its first sample it writes `ready`; when the service dies, its next sample must
/// fail within `SERVICE_DEATH_LIMIT`: it says so and exits 0.
pub(crate) fn replay_stream_learner(buffer: &RemoteBuffer, ready: &Path) -> anyhow::Result<()> {
    let mut first = true;
    let mut samples = 0u64;
    loop {
        let started = Instant::now();
        let (batch, _) = match buffer.sample(256, Some(Duration::from_secs(20))) {
            Ok(sampled) => sampled,
            Err(e) => {
                println!("{}: {samples} samples of 256 rows, each checked whole, before", host());
                return service_died("learner", started, &anyhow::Error::new(e));
            }
        };
        let (_, bad) = check_rows_whole(&batch)?;
        ensure!(bad.is_empty(), "a sampled batch has {} rows not whole: {:?}", bad.len(), bad.first());
        samples += 1;
        if first {
            put(ready, &serde_json::to_string(&Ready { pid: std::process::id(), rows: Vec::new() })?)?;
            first = false;
        }
    }
}

/// How long a client may take to fail once its service is killed.
const SERVICE_DEATH_LIMIT: Duration = Duration::from_secs(10);

/// A call that failed because the service died: fine if it failed within
/// [`SERVICE_DEATH_LIMIT`] of its start, with the error it gave.
fn service_died(who: &str, started: Instant, e: &anyhow::Error) -> anyhow::Result<()> {
    let took = started.elapsed();
    ensure!(took < SERVICE_DEATH_LIMIT, "{who}: the call took {took:?} to fail: {e:#}");
    println!("{}: {who}: the call failed {:.0} ms after it began: {e:#}", host(), took.as_secs_f64() * 1e3);
    Ok(())
}

/// Rows of any actor checked whole: each row's `obs` is its own key's (no bound on `seq`).
pub(crate) fn check_rows_whole(batch: &TensorDict) -> anyhow::Result<(usize, Vec<(usize, String)>)> {
    let key = batch.get_tensor("key")?.contiguous()?.to_vec::<i64>()?;
    let actors: Vec<i64> = key.iter().step_by(2).copied().collect();
    check_rows_of(batch, &actors, i64::MAX)
}

/// After an actor by value was killed mid-stream: the service holds no reservation of it, and
/// every sampled row is whole.
pub(crate) fn replay_after_stream_death(buffer: &RemoteBuffer, ready: &Path) -> anyhow::Result<()> {
    wait_for(ready, WAIT)?;
    let took = eventually("the killed actor's session released", Duration::from_secs(30), || {
        Ok(buffer.stats()?.open_reservations == 0)
    })?;
    let stats = buffer.stats()?;
    println!(
        "{}: {took:?} after watching: {} open reservations, {} rows written in all",
        host(),
        stats.open_reservations,
        stats.write_count
    );
    let mut checked = 0;
    for _ in 0..50 {
        let (batch, _) = buffer.sample(256, Some(Duration::from_secs(10)))?;
        let (whole, bad) = check_rows_whole(&batch)?;
        ensure!(bad.is_empty(), "{} of 256 sampled rows not whole: {:?}", bad.len(), bad.first());
        checked += whole;
    }
    println!("{}: {checked} rows sampled by value, every one whole", host());
    Ok(())
}
