//! Rows of tensor files read with explicit I/O instead of through a mapping: the one
//! implementation behind [`TensorDict::gather_direct`](crate::TensorDict::gather_direct) and the
//! replay crate's reads of a storage folder on a network filesystem.
//!
//! The rows asked for are sorted and deduplicated; rows close together in a file are read in
//! one request ([`MERGE_GAP`], [`MAX_MERGED_READ`]); every read of every file is in flight at
//! once through the `aio` engine; then each row is copied once, from the read buffers into a
//! new heap tensor, in the order asked.

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap_tensor::{DType, Layout, Location, Tensor};
use tensordict_aio::{AlignedBuf, BufPart, Engine};

use crate::{Error, KeyPath, ReadMode, Result};

/// Reads of neighbouring rows of one file are merged while the merged read stays within this
/// many bytes.
pub const MAX_MERGED_READ: usize = 1 << 20;

/// Rows closer than this many bytes in a file are read in one request, the bytes between them
/// read and dropped: a request costs more than a few KiB of transfer, on a network filesystem
/// most of all.
pub const MERGE_GAP: usize = 4096;

/// Where the rows of one tensor lie in a file, and what they are.
#[derive(Clone, Debug)]
pub struct RowsInFile {
    file: Arc<File>,
    path: PathBuf,
    key: KeyPath,
    dtype: DType,
    row_dims: Vec<usize>,
    row_bytes: usize,
    start_bytes: u64,
    stride_bytes: u64,
}

impl RowsInFile {
    /// The rows of a tensor `key` stored in `file` (opened with `O_DIRECT` for
    /// [`ReadMode::Direct`]) as a C-contiguous array from its first byte: row `r` is at
    /// `r * row_bytes`, where a row is `row_dims` elements of `dtype`. `path` names the file in
    /// errors. A row too large to size is an error naming the key.
    pub fn contiguous(
        file: Arc<File>,
        path: impl Into<PathBuf>,
        key: KeyPath,
        dtype: DType,
        row_dims: &[usize],
    ) -> Result<Self> {
        let row_bytes = dtype.bytes_of(row_dims).map_err(|source| Error::Tensor { key: key.clone(), source })?;
        Ok(RowsInFile {
            file,
            path: path.into(),
            key,
            dtype,
            row_dims: row_dims.to_vec(),
            row_bytes,
            start_bytes: 0,
            stride_bytes: row_bytes as u64,
        })
    }

    /// The same rows, row 0 at byte `start_bytes` of the file and each next row `stride_bytes`
    /// further (a view's rows: a slice with a step, a narrowed tensor).
    #[must_use]
    pub fn placed(mut self, start_bytes: u64, stride_bytes: u64) -> Self {
        self.start_bytes = start_bytes;
        self.stride_bytes = stride_bytes;
        self
    }

    /// Bytes of one row.
    pub fn row_bytes(&self) -> usize {
        self.row_bytes
    }

    /// The file's path, as errors name it.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn row_start(&self, row: usize) -> u64 {
        self.start_bytes + row as u64 * self.stride_bytes
    }

    fn io_err(&self, source: io::Error) -> Error {
        Error::Io { op: "read rows", path: self.path.clone(), source }
    }
}

/// One read: rows `first..end` (of those asked for, at least) in `len` bytes from file offset
/// `offset`, row `first` starting `skip` bytes in.
struct Run {
    first: usize,
    end: usize,
    offset: u64,
    len: usize,
    skip: usize,
}

/// Rows `rows` (any order, repeats allowed) of every tensor of `sources`, read from their files
/// through `engine` with every read in flight at once: one new heap tensor per source, of
/// shape `[rows.len(), row_dims...]`, its rows in the order asked.
///
/// Rows are the caller's to check against the files: a file that ends before a row does is an
/// [`Error::Io`] (`UnexpectedEof`) naming the file and the rows, never a short tensor.
pub fn read_file_rows(engine: &Engine, sources: &[RowsInFile], rows: &[usize], mode: ReadMode) -> Result<Vec<Tensor>> {
    let mut outs = Vec::with_capacity(sources.len());
    for source in sources {
        let mut dims = vec![rows.len()];
        dims.extend_from_slice(&source.row_dims);
        // Every byte is written by the read below before the tensor is handed out.
        outs.push(
            Tensor::zeros(dims, source.dtype, &Location::Heap)
                .map_err(|e| Error::Tensor { key: source.key.clone(), source: e })?,
        );
    }
    read_file_rows_into(engine, sources, rows, mode, &mut outs)?;
    Ok(outs)
}

/// [`read_file_rows`] into existing tensors, one per source, each contiguous in host memory
/// (heap, pinned, shared memory) with the source's dtype and shape `[rows.len(), row_dims...]`:
/// what a loader reading every batch into the same buffers calls. The tensors are checked
/// before anything is read; they are written through their storage (a clone of a tensor sees
/// the rows).
pub fn read_file_rows_into(
    engine: &Engine,
    sources: &[RowsInFile],
    rows: &[usize],
    mode: ReadMode,
    outs: &mut [Tensor],
) -> Result<()> {
    if outs.len() != sources.len() {
        return Err(Error::InvalidArgument {
            op: "read_file_rows_into",
            detail: format!("{} tensors for {} sources", outs.len(), sources.len()),
        });
    }
    // Each tensor's bytes, as one `u8` view of its storage.
    let mut bytes = Vec::with_capacity(outs.len());
    for (source, out) in sources.iter().zip(outs.iter()) {
        let mut dims = vec![rows.len()];
        dims.extend_from_slice(&source.row_dims);
        if out.dtype() != source.dtype || out.dims() != dims.as_slice() || !out.is_contiguous() {
            return Err(Error::InvalidArgument {
                op: "read_file_rows_into",
                detail: format!(
                    "key `{}`: rows go into a contiguous {} tensor of shape {dims:?}, not a {} {:?} one",
                    source.key,
                    source.dtype,
                    out.dtype(),
                    out.dims()
                ),
            });
        }
        let as_tensor_err = |e| Error::Tensor { key: source.key.clone(), source: e };
        let layout = Layout::contiguous([out.nbytes()]).map_err(as_tensor_err)?;
        let offset = out.byte_offset() + out.layout().offset_elems() * out.dtype().size_in_bytes();
        bytes.push(Tensor::from_storage(Arc::clone(out.storage()), offset, DType::U8, layout).map_err(as_tensor_err)?);
    }
    let Some(first) = sources.first() else { return Ok(()) };
    let mut sorted = rows.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let plans: Vec<Vec<Run>> = sources
        .iter()
        .map(|s| if s.row_bytes == 0 || sorted.is_empty() { Vec::new() } else { plan_runs(s, &sorted, mode) })
        .collect();

    let lens: Vec<usize> = plans.iter().flatten().map(|run| run.len).collect();
    let total: usize = lens.iter().sum();
    let buffer_err = |source| first.io_err(source);
    let parts = AlignedBuf::new(total).and_then(|b| b.split(&lens)).map_err(buffer_err)?;
    let mut parts = parts.into_iter();
    let mut reads = Vec::with_capacity(lens.len());
    for (source, runs) in sources.iter().zip(&plans) {
        for (run, part) in runs.iter().zip(parts.by_ref()) {
            reads.push((Arc::clone(&source.file), run.offset, part));
        }
    }
    let mut back = engine.read_many(reads).into_iter();
    let mut filled = Vec::with_capacity(lens.len());
    for (source, runs) in sources.iter().zip(&plans) {
        for run in runs {
            let (result, part) =
                back.next().ok_or_else(|| source.io_err(io::Error::other("a read did not come back")))?;
            let got = result.map_err(|e| source.io_err(e))?;
            let wanted =
                run.skip as u64 + source.row_start(run.end - 1) + source.row_bytes as u64 - source.row_start(run.first);
            if (got as u64) < wanted {
                return Err(source.io_err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!(
                        "key `{}`: a read of rows {}..{} at byte {} returned {got} of {wanted} bytes (the file is \
                         shorter than its tensor)",
                        source.key, run.first, run.end, run.offset
                    ),
                )));
            }
            filled.push(part);
        }
    }
    let whole = if total == 0 {
        None
    } else {
        Some(BufPart::join(filled).map_err(|_| buffer_err(io::Error::other("a read buffer did not come back")))?)
    };
    let whole = whole.as_ref().map_or(&[][..], |b| b.as_slice());

    let mut at = 0;
    for ((source, runs), out) in sources.iter().zip(&plans).zip(&mut bytes) {
        if runs.is_empty() {
            continue;
        }
        let mut dst = out.as_mut_slice::<u8>().map_err(|e| Error::Tensor { key: source.key.clone(), source: e })?;
        let starts: Vec<usize> =
            runs.iter().scan(at, |next, run| Some(std::mem::replace(next, *next + run.len))).collect();
        let row_bytes = source.row_bytes;
        for (dst, &r) in dst.chunks_exact_mut(row_bytes).zip(rows) {
            let i = runs.partition_point(|run| run.end <= r);
            let run = &runs[i];
            // Within the read: no overflow, the read holds the row (checked above).
            let from = starts[i]
                + run.skip
                + usize::try_from(source.row_start(r) - source.row_start(run.first)).unwrap_or(usize::MAX);
            dst.copy_from_slice(&whole[from..from + row_bytes]);
        }
        at += runs.iter().map(|run| run.len).sum::<usize>();
    }
    Ok(())
}

/// The reads of `sorted` (distinct, ascending) rows of `source`: a row joins the run before it
/// when the bytes between them are at most [`MERGE_GAP`] and the run stays within
/// [`MAX_MERGED_READ`]; each run's span is aligned to 4 KiB for `O_DIRECT`.
fn plan_runs(source: &RowsInFile, sorted: &[usize], mode: ReadMode) -> Vec<Run> {
    let row_bytes = source.row_bytes as u64;
    let mut runs: Vec<Run> = Vec::new();
    for &r in sorted {
        let start = source.row_start(r);
        if let Some(run) = runs.last_mut() {
            let run_start = source.row_start(run.first);
            let run_end = source.row_start(run.end - 1) + row_bytes;
            if start <= run_end + MERGE_GAP as u64 && start + row_bytes - run_start <= MAX_MERGED_READ as u64 {
                run.end = r + 1;
                continue;
            }
        }
        runs.push(Run { first: r, end: r + 1, offset: 0, len: 0, skip: 0 });
    }
    for run in &mut runs {
        let (start, end) = (source.row_start(run.first), source.row_start(run.end - 1) + row_bytes);
        (run.offset, run.len, run.skip) = tensordict_aio::read_span(start, end, mode == ReadMode::Direct);
    }
    runs
}

#[cfg(test)]
mod tests {
    use std::io::Write as _;

    use super::*;

    fn source(file: Arc<File>, row_bytes: usize) -> RowsInFile {
        RowsInFile::contiguous(file, "rows.bin", KeyPath::from("x"), DType::U8, &[row_bytes]).unwrap()
    }

    fn spans(runs: &[Run]) -> Vec<(usize, usize)> {
        runs.iter().map(|run| (run.first, run.end)).collect()
    }

    #[test]
    fn rows_within_the_gap_share_a_read_and_reads_stop_at_the_limit() {
        let dir = tempfile::tempdir().unwrap();
        let file = Arc::new(File::create(dir.path().join("f")).unwrap());
        // 1000-byte rows: 4 rows apart is a 3000-byte gap (merged), 6 apart is 5000 (not).
        let s = source(Arc::clone(&file), 1000);
        assert_eq!(spans(&plan_runs(&s, &[0, 1, 4, 10, 11], ReadMode::Buffered)), [(0, 5), (10, 12)]);
        // A run never passes MAX_MERGED_READ.
        let all: Vec<usize> = (0..3000).collect();
        let runs = plan_runs(&s, &all, ReadMode::Buffered);
        assert!(runs.iter().all(|run| run.len <= MAX_MERGED_READ), "{:?}", spans(&runs));
        assert_eq!(spans(&runs).first(), Some(&(0, MAX_MERGED_READ / 1000)));
        // Strided rows: a 2000-byte stride leaves 1000 bytes between rows, inside the gap.
        let strided = source(Arc::clone(&file), 1000).placed(500, 2000);
        let runs = plan_runs(&strided, &[0, 1, 2, 9], ReadMode::Buffered);
        assert_eq!(spans(&runs), [(0, 3), (9, 10)]);
        assert_eq!((runs[0].offset, runs[0].len), (500, 5000));
        // O_DIRECT spans are whole 4 KiB blocks holding the rows.
        let runs = plan_runs(&strided, &[0, 1, 2], ReadMode::Direct);
        assert_eq!((runs[0].offset, runs[0].len, runs[0].skip), (0, 8192, 500));
        // Every row the same bytes (a stride of 0): one read of one row.
        let broadcast = source(file, 1000).placed(0, 0);
        let runs = plan_runs(&broadcast, &[0, 5, 900], ReadMode::Buffered);
        assert_eq!((spans(&runs), runs[0].len), (vec![(0, 901)], 1000));
    }

    #[test]
    fn rows_come_back_in_the_order_asked_and_a_short_file_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("rows.bin");
        let mut f = File::create(&path).unwrap();
        // 100 rows of 10 bytes, row r filled with r.
        for r in 0..100u8 {
            f.write_all(&[r; 10]).unwrap();
        }
        drop(f);
        let file = Arc::new(File::open(&path).unwrap());
        let engine = Engine::new().unwrap();
        let rows = [99, 3, 3, 50, 0, 51];
        let got = read_file_rows(&engine, &[source(Arc::clone(&file), 10)], &rows, ReadMode::Buffered).unwrap();
        let bytes = got[0].to_bytes().unwrap();
        assert_eq!(got[0].dims(), [6, 10]);
        for (k, &r) in rows.iter().enumerate() {
            assert!(bytes[k * 10..(k + 1) * 10].iter().all(|&b| usize::from(b) == r), "row {k}");
        }
        match read_file_rows(&engine, &[source(file, 10)], &[98, 100], ReadMode::Buffered) {
            Err(Error::Io { source, path, .. }) => {
                assert_eq!(source.kind(), io::ErrorKind::UnexpectedEof);
                assert_eq!(path, Path::new("rows.bin"));
                assert!(source.to_string().contains("rows 98..101"), "{source}");
            }
            other => panic!("a row past the end of the file: {other:?}"),
        }
    }
}
