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
        .write_rows(&tensordict_aio::Engine::new()?, &half_rows, &actor_rows(9, 900, half.len())?)
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
