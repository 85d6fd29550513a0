//! Stale reads of files rewritten in place on another node.

use super::*;

/// Rows and values per row of the large and the small folder of the stale-read test.
pub(crate) const STALE_LARGE: (usize, usize) = (8192, 64);
pub(crate) const STALE_SMALL: (usize, usize) = (32, 8);

/// The value at column `col` of row `row` after it was written in round `round` (0: never).
pub(crate) fn stale_value(round: u64, row: usize, col: usize) -> i64 {
    if round == 0 { 0 } else { round as i64 * 10_000_000 + row as i64 * 100 + col as i64 }
}

/// A small deterministic generator (xorshift), for the rows of each round.
pub(crate) struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }

    /// `k` distinct rows below `n`, ascending.
    fn rows(&mut self, n: usize, k: usize) -> Vec<usize> {
        let mut rows: Vec<usize> = (0..k).map(|_| self.below(n)).collect();
        rows.sort_unstable();
        rows.dedup();
        rows
    }
}

/// One round's message: the round and the rows written in each folder.
#[derive(serde::Serialize, serde::Deserialize)]
pub(crate) struct StaleRound {
    round: u64,
    large: Vec<usize>,
    small: Vec<usize>,
}

/// What the writer sends first: each folder and its schema.
#[derive(serde::Serialize, serde::Deserialize)]
pub(crate) struct StaleFolders {
    folders: Vec<(std::path::PathBuf, Schema)>,
}

pub(crate) fn stale_writer(dir: &Path, port: u16, seconds: f64) -> anyhow::Result<()> {
    let engine = tensordict_aio::Engine::new()?;
    let mut folders = Vec::new();
    let mut files = Vec::new();
    for (name, (rows, width)) in [("stale-large", STALE_LARGE), ("stale-small", STALE_SMALL)] {
        let folder = dir.join(name);
        let mut schema = TensorDict::new([1]);
        schema.set("v", Tensor::zeros([1, width], DType::I64, &Location::Heap)?)?;
        let td = schema.memmap_like(&folder, Some(rows))?;
        td.flush()?;
        let reference = td.to_ref()?;
        drop(td);
        files.push((RowFiles::new(&folder, &reference.schema)?, rows, width));
        folders.push((folder, std::sync::Arc::unwrap_or_clone(reference.schema)));
    }
    let listener = TcpListener::bind(("0.0.0.0", port)).with_context(|| format!("listening on port {port}"))?;
    let (stream, peer) = listener.accept()?;
    stream.set_nodelay(true)?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut writer = stream;
    writeln!(writer, "{}", serde_json::to_string(&StaleFolders { folders })?)?;
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let limit = Duration::from_secs_f64(seconds);
    let start = Instant::now();
    let mut round = 0u64;
    let mut line = String::new();
    while start.elapsed() < limit {
        round += 1;
        let mut written = Vec::new();
        for (files, rows, width) in &files {
            let chosen = rng.rows(*rows, 16.min(*rows / 2));
            let values: Vec<i64> =
                chosen.iter().flat_map(|&r| (0..*width).map(move |c| stale_value(round, r, c))).collect();
            let mut batch = TensorDict::new([chosen.len()]);
            batch.set("v", Tensor::from_slice(&values, [chosen.len(), *width])?)?;
            files
                .write(&engine, &files.row_index(&chosen)?, &batch)
                .with_context(|| format!("round {round}: writing"))?;
            written.push(chosen);
        }
        let small = written.pop().unwrap_or_default();
        let large = written.pop().unwrap_or_default();
        writeln!(writer, "{}", serde_json::to_string(&StaleRound { round, large, small })?)?;
        line.clear();
        ensure!(reader.read_line(&mut line)? > 0, "{peer} hung up at round {round}");
    }
    // The end: an empty line.
    writeln!(writer)?;
    println!("{}: {round} rounds of rewrites in place in {:.1} s", host(), start.elapsed().as_secs_f64());
    Ok(())
}

pub(crate) fn stale_reader(addr: &str, label: &str) -> anyhow::Result<()> {
    let (mut reader, mut writer) = connect_lines(addr)?;
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let folders: StaleFolders = serde_json::from_str(&line)?;
    let engine = tensordict_aio::Engine::new()?;
    // Per folder: its files, its row width, the last round each row was written.
    let mut sets = Vec::new();
    // The control: each folder's file opened once, read with pread through the page cache.
    let mut kept = Vec::new();
    for (folder, schema) in &folders.folders {
        let files = RowFiles::new(folder, schema)?;
        let (_, tensor) = schema.tensors().into_iter().next().context("a folder without tensors")?;
        let width = tensor.shape[1];
        kept.push(std::fs::File::open(folder.join(&tensor.name))?);
        sets.push((files, width, vec![0u64; schema.batch_size[0]]));
    }
    let mut kept_stale = [0u64; 2];
    let mut kept_reads = [0u64; 2];
    let names = ["large", "small"];
    let modes = [("buffered", ReadMode::Buffered), ("direct", ReadMode::Direct)];
    // stale[folder][mode]: rows read older than their last write; reads[folder][mode]: rows read.
    let mut stale = [[0u64; 2]; 2];
    let mut reads = [[0u64; 2]; 2];
    let mut first_stale: Vec<String> = Vec::new();
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    let mut rounds = 0u64;
    loop {
        line.clear();
        ensure!(reader.read_line(&mut line)? > 0, "the writer hung up");
        if line.trim().is_empty() {
            break;
        }
        let round: StaleRound = serde_json::from_str(&line)?;
        rounds = round.round;
        for (f, written) in [&round.large, &round.small].into_iter().enumerate() {
            let (files, width, last) = &mut sets[f];
            for &r in written {
                last[r] = round.round;
            }
            // The rows just written and as many others.
            let mut rows = written.clone();
            rows.extend(rng.rows(last.len(), written.len()));
            // Both modes, in turn first.
            let order = if round.round.is_multiple_of(2) { [0, 1] } else { [1, 0] };
            for m in order {
                let td = files.read_rows(&engine, &files.row_index(&rows)?, modes[m].1)?;
                let got = td.get_tensor("v")?.to_vec::<i64>()?;
                if m == 0 {
                    for &r in &rows {
                        let mut buf = vec![0u8; *width * 8];
                        std::os::unix::fs::FileExt::read_exact_at(&kept[f], &mut buf, (r * *width * 8) as u64)?;
                        kept_reads[f] += 1;
                        let first = i64::from_le_bytes(buf[..8].try_into()?);
                        kept_stale[f] += u64::from(first != stale_value(last[r], r, 0));
                    }
                }
                for (k, &r) in rows.iter().enumerate() {
                    reads[f][m] += 1;
                    let row = &got[k * *width..(k + 1) * *width];
                    let want: Vec<i64> = (0..*width).map(|c| stale_value(last[r], r, c)).collect();
                    if row != want.as_slice() {
                        stale[f][m] += 1;
                        if first_stale.len() < 5 {
                            first_stale.push(format!(
                                "round {}: {} folder, {} read of row {r}: starts {:?}, written in round {}",
                                round.round,
                                names[f],
                                modes[m].0,
                                &row[..2.min(row.len())],
                                last[r]
                            ));
                        }
                    }
                }
            }
        }
        writeln!(writer, "ok")?;
    }
    for f in 0..2 {
        for m in 0..2 {
            let json = serde_json::json!({
                "bench": "stale-reads",
                "fs": label,
                "file": names[f],
                "file_bytes": sets[f].2.len() * sets[f].1 * 8,
                "read": modes[m].0,
                "rounds": rounds,
                "rows_read": reads[f][m],
                "stale_rows": stale[f][m],
            });
            println!("{json}");
        }
        let json = serde_json::json!({
            "bench": "stale-reads",
            "fs": label,
            "file": names[f],
            "file_bytes": sets[f].2.len() * sets[f].1 * 8,
            "read": "buffered, one descriptor kept open (not relied on)",
            "rounds": rounds,
            "rows_read": kept_reads[f],
            "stale_rows": kept_stale[f],
        });
        println!("{json}");
    }
    for what in &first_stale {
        println!("{}: stale: {what}", host());
    }
    let total: u64 = stale.iter().flatten().sum();
    ensure!(rounds >= 100, "only {rounds} rounds in the time given");
    ensure!(total == 0, "{total} rows read older than their last write (first: {})", first_stale.join("; "));
    println!("{}: {rounds} rounds, every row read (buffered and O_DIRECT, fresh opens) was its last write", host());
    Ok(())
}
