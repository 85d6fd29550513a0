//! PyTorch tensordict's distributed "remote update" example, in Rust, with two real processes.
//!
//! The first process creates a memmap dict `{"memmap": u8 [FRAMES, 640, 640, 3]}` (in sparse
//! files; 50 frames, 61 MB, unless told otherwise) and starts a worker process. It sends the worker a reference to the dict (a
//! few hundred bytes) and the rows `[4, 5, 6, 7, 998]`; the worker maps the same file, writes
//! ones into those rows, publishes and returns the reference. The first process then checks
//! `memmap[idx, :1, :1, :1]` is all ones.
//!
//! It also makes the same call by value, as an RPC framework without references must: the
//! dict's bytes sent to the worker and sent back. The two times are printed side by side.
//!
//! This is also the pattern for a service of your own that takes and returns references: a
//! `#[tarpc::service]` whose methods take [`TensorDictRef`]s, served with [`tensordict_rpc::serve`].
//!
//! ```sh
//! cargo run --release --example remote_update          # 50 frames: a few seconds
//! cargo run --release --example remote_update -- 1000  # PyTorch's 1000 frames (1.2 GB by value)
//! ```
//!
//! The socket and its lock live in the example's temporary folder, removed when it ends.

use std::time::Instant;

use anyhow::{Context as _, ensure};
use memmap_tensor::{Access, DType, Location, Tensor};
use tarpc::context::Context;
use tensordict::{Index, TensorDict};
use tensordict_rpc::{
    BlockingClient, ClientOptions, Endpoint, InlineDict, ServerOptions, TensorDictRef, ToRef, WireError,
};

/// The rows written: PyTorch's `[4, 5, 6, 7, 998]`, the last one counted from the end.
const ROWS: [i64; 5] = [4, 5, 6, 7, -2];
/// Frames of the dict unless the command line gives a number.
const FRAMES: usize = 50;
/// By-value calls carry the whole dict in one message.
const BIG_FRAMES: usize = 2 << 30;

/// What the worker does. The trait is the contract between the two processes.
#[tarpc::service]
trait Updater {
    /// Writes ones into `rows` of the dict `target` refers to; returns its reference at the
    /// generation that holds them.
    async fn fill_ones(target: TensorDictRef, rows: Vec<i64>) -> Result<TensorDictRef, WireError>;
    /// The same by value: the dict comes in whole and goes back whole.
    async fn fill_ones_by_value(dict: InlineDict, rows: Vec<i64>) -> Result<InlineDict, WireError>;
}

#[derive(Clone)]
struct UpdaterServer;

/// `td[rows] = 1`.
fn fill(td: &mut TensorDict, rows: &[i64]) -> tensordict::Result<()> {
    let mut ones = TensorDict::new([rows.len()]);
    for (key, t) in td.leaves() {
        let mut dims = t.dims().to_vec();
        dims[0] = rows.len();
        let count: usize = dims.iter().product();
        let bytes = vec![1u8; count * t.dtype().size_in_bytes()];
        let one = Tensor::from_bytes(&bytes, t.dtype(), dims)
            .map_err(|source| tensordict::Error::Tensor { key: key.clone(), source })?;
        ones.set(key, one)?;
    }
    td.set_at(Index::List(rows.to_vec()), &ones)
}

fn wire(e: tensordict::Error) -> WireError {
    WireError::InvalidRequest { detail: e.to_string() }
}

impl Updater for UpdaterServer {
    async fn fill_ones(self, _: Context, target: TensorDictRef, rows: Vec<i64>) -> Result<TensorDictRef, WireError> {
        let mut td = target.open(Access::ReadWrite).map_err(wire)?;
        fill(&mut td, &rows).map_err(wire)?;
        td.publish().map_err(wire)?;
        td.to_ref().map_err(wire)
    }

    async fn fill_ones_by_value(self, _: Context, dict: InlineDict, rows: Vec<i64>) -> Result<InlineDict, WireError> {
        let mut td = dict.to_dict().map_err(wire)?;
        fill(&mut td, &rows).map_err(wire)?;
        InlineDict::new(&td).map_err(wire)
    }
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if let [_, role, endpoint, runtime] = args.as_slice()
        && role == "worker"
    {
        return worker(endpoint, runtime);
    }
    let frames = match args.get(1) {
        Some(n) => n.parse().with_context(|| format!("`{n}`: give a number of frames (at least 8)"))?,
        None => FRAMES,
    };
    ensure!(frames >= 8, "at least 8 frames: rows 4 to 7 and -2 are written");
    let dir = tempfile::tempdir()?;
    // The socket and its lock go in the temporary folder, so the example leaves nothing behind.
    let runtime = dir.path().join("run");
    std::os::unix::fs::DirBuilderExt::mode(&mut std::fs::DirBuilder::new(), 0o700).create(&runtime)?;
    let endpoint: Endpoint = "uds:remote-update".parse()?;

    // The dict: frames of 640 x 640 x 3 bytes, in a sparse file.
    let mut schema = TensorDict::new([1]);
    schema.set("memmap", Tensor::zeros([1, 640, 640, 3], DType::U8, &Location::Heap)?)?;
    let td = schema.memmap_like(dir.path().join("data"), Some(frames))?;
    println!("dict: {frames} frames, {} MB in {}", td.nbytes() / 1_000_000, dir.path().join("data").display());

    let mut worker = std::process::Command::new(std::env::current_exe()?)
        .args(["worker", &endpoint.to_string(), &runtime.display().to_string()])
        .spawn()
        .context("starting the worker")?;
    let result = drive(&endpoint, &runtime, &td);
    // Whatever happened: the worker goes.
    let _ = worker.kill();
    let _ = worker.wait();
    result
}

/// The worker process: serves until killed.
fn worker(endpoint: &str, runtime: &str) -> anyhow::Result<()> {
    let endpoint: Endpoint = endpoint.parse()?;
    let options = ServerOptions::default().max_frame_bytes(BIG_FRAMES).runtime_dir(runtime);
    let _server = tensordict_rpc::serve(&endpoint, UpdaterServer.serve(), options)?;
    loop {
        std::thread::park();
    }
}

fn drive(endpoint: &Endpoint, runtime: &std::path::Path, td: &TensorDict) -> anyhow::Result<()> {
    let options = ClientOptions::default()
        .max_frame_bytes(BIG_FRAMES)
        .call_timeout(std::time::Duration::from_secs(300))
        .runtime_dir(runtime);
    // Retries until the worker listens.
    let client: BlockingClient<UpdaterClient> = BlockingClient::connect(endpoint, &options)?;

    let reference = td.to_ref()?;
    let sent_bytes = serde_json::to_vec(&reference)?.len();
    let started = Instant::now();
    let back = client.invoke(async |c, ctx| c.fill_ones(ctx, reference.clone(), ROWS.to_vec()).await)?;
    let by_ref = started.elapsed();

    // memmap[idx, :1, :1, :1] is all ones, seen through this process's own mapping.
    let rows = td.index(Index::List(ROWS.to_vec()))?;
    let corner = rows.get_tensor("memmap")?.narrow(1, 0, 1)?.narrow(2, 0, 1)?.narrow(3, 0, 1)?;
    ensure!(corner.to_vec::<u8>()? == [1u8; 5], "the worker's writes are not in the file");
    ensure!(back.generation.counter == reference.generation.counter + 1, "the worker did not publish");
    // The untouched rows stay zero.
    ensure!(td.get_tensor("memmap")?.select(0, 3)?.to_vec::<u8>()?.iter().all(|&b| b == 0));

    // The same call by value.
    let started = Instant::now();
    let dict = InlineDict::new(td)?;
    let returned = client.invoke(async |c, ctx| c.fill_ones_by_value(ctx, dict, ROWS.to_vec()).await)?;
    let updated = returned.to_dict()?;
    let by_value = started.elapsed();
    ensure!(updated.get_tensor("memmap")?.select(0, -2)?.to_vec::<u8>()?.iter().all(|&b| b == 1));

    println!("by reference: {by_ref:>10.2?}  ({sent_bytes} bytes of reference each way)");
    println!("by value:     {by_value:>10.2?}  ({} MB each way)", td.nbytes() / 1_000_000);
    println!("memmap[idx, :1, :1, :1] is all ones: ok");
    Ok(())
}
