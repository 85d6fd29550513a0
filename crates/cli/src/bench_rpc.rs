//! `tdict bench rpc`: what passing a dict by reference costs next to a bare round trip, and what
//! it saves next to sending the dict's bytes, over a Unix socket or TCP, in one run.
//!
//! A server (on threads of its own, in this process) offers the calls below; a blocking client
//! times them. The remote update writes ones into rows `[4, 5, 6, 7, 98]` of a
//! `u8 [100, 640, 640, 3]` dict (123 MB, its pages allocated): by reference (the server maps the
//! same file), by value (the dict's bytes to the server and back, as an RPC framework without
//! references must), and with only the five rows' bytes sent (for scale).

use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use memmap_tensor::{Access, DType, Location, Tensor};
use serde_json::json;
use tarpc::context::Context;
use tensordict::{Index, TensorDict};
use tensordict_rpc::{
    BlockingClient, ClientOptions, Endpoint, InlineDict, ServerOptions, TensorDictRef, ToRef, Token, WireError,
};

/// Rows the remote update writes.
const ROWS: [i64; 5] = [4, 5, 6, 7, 98];
/// Frames large enough for the dict by value.
const BIG_FRAMES: usize = 256 << 20;

/// The calls the benchmark times.
#[tarpc::service]
trait Bench {
    /// Returns its argument: the bare round trip.
    async fn echo(x: u64) -> u64;
    /// Returns the reference it got (decoded and checked on the way in, as every reference is).
    async fn bounce(reference: TensorDictRef) -> TensorDictRef;
    /// `target[rows] = 1` on the storage the reference points to; returns the new reference.
    async fn fill_by_ref(target: TensorDictRef, rows: Vec<i64>) -> Result<TensorDictRef, WireError>;
    /// `dict[rows] = 1` on a dict sent whole; returns it whole.
    async fn fill_by_value(dict: InlineDict, rows: Vec<i64>) -> Result<InlineDict, WireError>;
    /// `target[rows] = values`, the rows' values sent by value.
    async fn write_rows(target: TensorDictRef, rows: Vec<i64>, values: InlineDict) -> Result<TensorDictRef, WireError>;
}

#[derive(Clone)]
struct BenchServer;

fn wire(e: tensordict::Error) -> WireError {
    WireError::InvalidRequest { detail: e.to_string() }
}

/// `td[rows] = 1` for every leaf.
fn fill_ones(td: &mut TensorDict, rows: &[i64]) -> tensordict::Result<()> {
    td.set_at(Index::List(rows.to_vec()), &ones(td, rows.len())?)
}

/// A heap dict of `rows` rows shaped like `td`, every byte 1.
fn ones(td: &TensorDict, rows: usize) -> tensordict::Result<TensorDict> {
    let mut out = TensorDict::new([rows]);
    for (key, t) in td.leaves() {
        let mut dims = t.dims().to_vec();
        dims[0] = rows;
        let len = t.dtype().bytes_of(&dims).map_err(|source| tensordict::Error::Tensor { key: key.clone(), source })?;
        let bytes = vec![1u8; len];
        let filled = Tensor::from_bytes(&bytes, t.dtype(), dims)
            .map_err(|source| tensordict::Error::Tensor { key: key.clone(), source })?;
        out.set(key, filled)?;
    }
    Ok(out)
}

impl Bench for BenchServer {
    async fn echo(self, _: Context, x: u64) -> u64 {
        x
    }

    async fn bounce(self, _: Context, reference: TensorDictRef) -> TensorDictRef {
        reference
    }

    async fn fill_by_ref(self, _: Context, target: TensorDictRef, rows: Vec<i64>) -> Result<TensorDictRef, WireError> {
        let mut td = target.open(Access::ReadWrite).map_err(wire)?;
        fill_ones(&mut td, &rows).map_err(wire)?;
        td.publish().map_err(wire)?;
        td.to_ref().map_err(wire)
    }

    async fn fill_by_value(self, _: Context, dict: InlineDict, rows: Vec<i64>) -> Result<InlineDict, WireError> {
        let mut td = dict.to_dict().map_err(wire)?;
        fill_ones(&mut td, &rows).map_err(wire)?;
        InlineDict::new(&td).map_err(wire)
    }

    async fn write_rows(
        self,
        _: Context,
        target: TensorDictRef,
        rows: Vec<i64>,
        values: InlineDict,
    ) -> Result<TensorDictRef, WireError> {
        let mut td = target.open(Access::ReadWrite).map_err(wire)?;
        td.set_at(Index::List(rows), &values.to_dict().map_err(wire)?).map_err(wire)?;
        td.publish().map_err(wire)?;
        td.to_ref().map_err(wire)
    }
}

/// The transport to measure.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub(crate) enum Transport {
    /// A Unix domain socket.
    Uds,
    /// TCP on the loopback, with a token.
    Tcp,
}

pub(crate) fn run(transport: Transport, iters: usize, as_json: bool) -> anyhow::Result<ExitCode> {
    let dir = tempfile::tempdir()?;
    let run_dir = dir.path().join("run");
    let token = Token::generate();
    let (endpoint, name): (Endpoint, &str) = match transport {
        Transport::Uds => (format!("uds:bench-{}", std::process::id()).parse()?, "uds"),
        Transport::Tcp => ("tcp:127.0.0.1:0".parse()?, "tcp"),
    };
    let server_options =
        ServerOptions::default().runtime_dir(&run_dir).token(token.clone()).max_frame_bytes(BIG_FRAMES);
    let server =
        tensordict_rpc::serve(&endpoint, BenchServer.serve(), server_options).context("starting the server")?;
    let client_options = ClientOptions::default()
        .runtime_dir(&run_dir)
        .token(token)
        .max_frame_bytes(BIG_FRAMES)
        .call_timeout(Duration::from_secs(600));
    let client: BlockingClient<BenchClient> = BlockingClient::connect(server.endpoint(), &client_options)?;

    // A 10-leaf dict to pass by reference.
    let mut ten = TensorDict::new([1000]);
    for i in 0..10 {
        ten.set(format!("leaf{i}"), Tensor::zeros([1000, 8], DType::F32, &Location::Heap)?)?;
    }
    let ten = ten.memmap(dir.path().join("ten"))?;
    let reference = ten.to_ref()?;
    let ref_bytes = bincode_size(&reference)?;

    let warmup = (iters / 10).max(10);
    let mut echo = Vec::with_capacity(iters);
    let mut bounce = Vec::with_capacity(iters);
    // Interleaved, so both see the same machine.
    for i in 0..iters + warmup {
        let started = Instant::now();
        let x = client.call(async |c, ctx| c.echo(ctx, i as u64).await)?;
        let echo_time = started.elapsed();
        anyhow::ensure!(x == i as u64, "echo returned {x} for {i}");
        let started = Instant::now();
        let back = client.call(async |c, ctx| c.bounce(ctx, reference.clone()).await)?;
        let bounce_time = started.elapsed();
        anyhow::ensure!(back.generation == reference.generation, "the reference came back changed");
        if i >= warmup {
            echo.push(echo_time);
            bounce.push(bounce_time);
        }
    }

    // What the reference's encoding costs a round trip: encoded and decoded twice (the call and
    // its answer), as the transport does, with no socket.
    let started = Instant::now();
    for _ in 0..iters {
        let there: TensorDictRef = bincode::deserialize(&bincode::serialize(&reference)?)?;
        let back: TensorDictRef = bincode::deserialize(&bincode::serialize(&there)?)?;
        anyhow::ensure!(back.generation == reference.generation, "the reference changed in its encoding");
    }
    let codec = started.elapsed() / u32::try_from(iters)?;

    // The remote update, three ways, on 123 MB with its pages allocated.
    let mut schema = TensorDict::new([1]);
    schema.set("memmap", Tensor::zeros([1, 640, 640, 3], DType::U8, &Location::Heap)?)?;
    let big = schema.memmap_like(dir.path().join("big"), Some(100))?;
    let target = big.to_ref()?;
    let started = Instant::now();
    let updated = client.invoke(async |c, ctx| c.fill_by_ref(ctx, target.clone(), ROWS.to_vec()).await)?;
    let by_ref = started.elapsed();
    anyhow::ensure!(corner(&big, 98)? == 1, "the update by reference is not in the file");

    let started = Instant::now();
    let whole = InlineDict::new(&big)?;
    let back = client.invoke(async |c, ctx| c.fill_by_value(ctx, whole, ROWS.to_vec()).await)?.to_dict()?;
    let by_value = started.elapsed();
    anyhow::ensure!(corner(&back, 98)? == 1, "the update by value came back without the rows");
    drop(back);

    let started = Instant::now();
    let values = InlineDict::new(&ones(&big, ROWS.len())?)?;
    client.invoke(async |c, ctx| c.write_rows(ctx, updated.clone(), ROWS.to_vec(), values).await)?;
    let rows_by_value = started.elapsed();

    let us = |d: Duration| d.as_secs_f64() * 1e6;
    let (echo_p50, echo_p99) = percentiles(&mut echo);
    let (ref_p50, ref_p99) = percentiles(&mut bounce);
    let report = json!({
        "transport": name,
        "iters": iters,
        "echo_p50_us": us(echo_p50),
        "echo_p99_us": us(echo_p99),
        "ref_p50_us": us(ref_p50),
        "ref_p99_us": us(ref_p99),
        "ref_bytes": ref_bytes,
        "ref_codec_us": us(codec),
        "update_by_ref_us": us(by_ref),
        "update_by_value_us": us(by_value),
        "update_rows_by_value_us": us(rows_by_value),
        "dict_bytes": big.nbytes(),
    });
    if as_json {
        out!("{report}");
    } else {
        out!("transport {name}, {iters} round trips each");
        out!("echo:       p50 {:>9.1} us  p99 {:>9.1} us", us(echo_p50), us(echo_p99));
        out!("reference:  p50 {:>9.1} us  p99 {:>9.1} us  ({ref_bytes} bytes, 10 leaves)", us(ref_p50), us(ref_p99));
        out!("  of which encoding and decoding it there and back: {:.2} us", us(codec));
        out!("update of rows {ROWS:?} of a {} MB dict:", big.nbytes() / 1_000_000);
        out!("  by reference        {:>12.1} us", us(by_ref));
        out!("  by value            {:>12.1} us  (the dict's bytes there and back)", us(by_value));
        out!("  rows' bytes alone   {:>12.1} us", us(rows_by_value));
    }
    drop(client);
    drop(server);
    Ok(ExitCode::SUCCESS)
}

/// `td["memmap"][row, 0, 0, 0]`.
fn corner(td: &TensorDict, row: i64) -> anyhow::Result<u8> {
    let t = td.get_tensor("memmap")?.select(0, row)?;
    Ok(t.narrow(0, 0, 1)?.narrow(1, 0, 1)?.narrow(2, 0, 1)?.to_vec::<u8>()?[0])
}

fn percentiles(times: &mut [Duration]) -> (Duration, Duration) {
    times.sort_unstable();
    let at = |q: usize| times.get((times.len() * q / 100).min(times.len().saturating_sub(1))).copied();
    (at(50).unwrap_or_default(), at(99).unwrap_or_default())
}

/// The size of `value` in the wire's encoding (bincode, as tarpc's transport writes it).
fn bincode_size<T: serde::Serialize>(value: &T) -> anyhow::Result<u64> {
    Ok(bincode::serialized_size(value)?)
}
