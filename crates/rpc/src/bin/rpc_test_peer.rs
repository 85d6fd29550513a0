//! A second process for the crate's tests: serves or calls the test `Echo` service.
//!
//! The runtime directory comes from the environment (`TDICT_RUNTIME_DIR`), as for any program.
//!
//! ```text
//! rpc-test-peer serve ENDPOINT [TOKEN_FILE]     prints the endpoint, then `ready`; serves until killed
//! rpc-test-peer worker ENDPOINT [TOKEN_FILE]    the same with the worker service (`tensordict_rpc::worker`)
//! rpc-test-peer sleep ENDPOINT MS [TOKEN_FILE]  prints `calling`, calls sleep(MS), prints `done` or `error: …`
//! rpc-test-peer echo ENDPOINT [SERVER_UID]      prints `ok` or `error: …` (exit status 2);
//!                                               SERVER_UID: a server uid to trust besides our own
//!
//! rpc-test-peer store-serve NAME [--dir D] [--capacity N] [--listen ENDPOINT --token-file F]
//!     serves the store NAME; prints `tcp ENDPOINT` when listening on TCP, then `ready PID`;
//!     serves until a client asks it to stop (or it is killed)
//! rpc-test-peer store-hold NAME KEY...    loads each KEY, prints `held KEY VERSION CHECKSUM` for
//!                                         each, then sleeps holding them until killed
//! rpc-test-peer store-mixed NAME SEED N   N mixed operations checking every content read;
//!                                         prints `mixed …` (a summary), exit status 1 on a mismatch
//! rpc-test-peer store-wait NAME KEY       loads KEY waiting forever; prints `loaded VERSION
//!                                         CHECKSUM`, or `error: …` (exit status 3)
//! rpc-test-peer store-put NAME KEY SEED   saves the 100-tensor state dict of SEED; prints `saved`
//! rpc-test-peer store-rm-full NAME DIR
//!     serves a folder store NAME in DIR (a small filesystem) from this process, saves `a` and
//!     `b`, fills DIR's filesystem, then tries to remove `a`: prints `refused: …` or `removed`,
//!     `after: KEYS`, `restarted: KEYS`; frees the room, removes `a` again and prints
//!     `removed` and `restarted: KEYS`
//! rpc-test-peer store-race NAME BYTES ROUNDS
//!     serves the store NAME in shared memory from this process; each round saves two dicts of
//!     BYTES bytes at once from two connections, prints `saved` or `refused: …` for each, and
//!     removes them; then prints `done`
//! ```

use std::io::Write;
use std::process::ExitCode;

#[path = "../../tests/common/echo.rs"]
mod echo;
#[cfg(feature = "store")]
#[path = "../../tests/common/store_data.rs"]
mod store_data;

use echo::{Echo, EchoClient, EchoServer};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            println!("error: {e:?}");
            ExitCode::from(2)
        }
    }
}

fn token(path: Option<&String>) -> tensordict_rpc::Result<Option<tensordict_rpc::Token>> {
    path.map(tensordict_rpc::Token::from_file).transpose()
}

type Failure = Box<dyn std::error::Error>;

fn run(args: &[String]) -> Result<(), Failure> {
    let usage = || -> Failure {
        format!("usage: serve ENDPOINT [TOKEN_FILE] | sleep ENDPOINT MS [TOKEN_FILE] | echo ENDPOINT [SERVER_UID]; got {args:?}")
            .into()
    };
    #[cfg(feature = "store")]
    if let Some(command) = args.first().and_then(|c| c.strip_prefix("store-")) {
        return store(command, &args[1..]);
    }
    let (command, endpoint) = match args {
        [command, endpoint, ..] => (command.as_str(), endpoint.parse::<tensordict_rpc::Endpoint>()?),
        _ => return Err(usage()),
    };
    match command {
        "serve" => {
            let mut options = tensordict_rpc::ServerOptions::default();
            options.token = token(args.get(2))?;
            let server = EchoServer { announce: true, ..EchoServer::default() };
            let handle = tensordict_rpc::serve(&endpoint, server.serve(), options)?;
            println!("{}", handle.endpoint());
            say("ready");
            loop {
                std::thread::park();
            }
        }
        "worker" => {
            let mut options = tensordict_rpc::ServerOptions::default();
            options.token = token(args.get(2))?;
            let handle = tensordict_rpc::worker::WorkerServer::new().serve_on(&endpoint, options)?;
            println!("{}", handle.endpoint());
            say("ready");
            loop {
                std::thread::park();
            }
        }
        "sleep" => {
            let ms: u64 = args.get(2).and_then(|s| s.parse().ok()).ok_or_else(usage)?;
            let mut options = tensordict_rpc::ClientOptions::default();
            options.token = token(args.get(3))?;
            let client: tensordict_rpc::BlockingClient<EchoClient> =
                tensordict_rpc::BlockingClient::connect(&endpoint, &options)?;
            say("calling");
            client.call(async |c, ctx| c.sleep(ctx, ms).await)?;
            println!("done");
            Ok(())
        }
        "echo" => {
            let mut options =
                tensordict_rpc::ClientOptions::default().connect_timeout(std::time::Duration::from_secs(2));
            if let Some(uid) = args.get(2) {
                options = options.allow_server_uid(uid.parse()?);
            }
            let client: tensordict_rpc::BlockingClient<EchoClient> =
                tensordict_rpc::BlockingClient::connect(&endpoint, &options)?;
            let back = client.call(async |c, ctx| c.echo(ctx, b"peer".to_vec()).await)?;
            if back != b"peer" {
                return Err(format!("echo returned {back:?}").into());
            }
            println!("ok");
            Ok(())
        }
        _ => Err(usage()),
    }
}

/// One line to the test that runs this process, flushed at once.
fn say(line: impl std::fmt::Display) {
    println!("{line}");
    std::io::stdout().flush().ok();
}

#[cfg(feature = "store")]
fn store(command: &str, args: &[String]) -> Result<(), Failure> {
    use tensordict_rpc::store::{Store, StoreOptions, StoreServer, Wait};

    let usage = || -> Failure { format!("store-{command}: bad arguments {args:?}").into() };
    let name = args.first().ok_or_else(usage)?;
    let connect = || Store::connect(name);
    match (command, &args[1..]) {
        ("serve", mut rest) => {
            let mut options = StoreOptions::default();
            let mut listen = None;
            let mut token_file = None;
            while let [flag, value, tail @ ..] = rest {
                match flag.as_str() {
                    "--dir" => options = options.dir(value),
                    "--capacity" => options = options.capacity(value.parse()?),
                    "--listen" => listen = Some(value.parse::<tensordict_rpc::Endpoint>()?),
                    "--token-file" => token_file = Some(tensordict_rpc::Token::from_file(value)?),
                    _ => return Err(usage()),
                }
                rest = tail;
            }
            if !rest.is_empty() {
                return Err(usage());
            }
            if let Some(listen) = listen {
                options = options.listen(listen, token_file.ok_or_else(usage)?);
            }
            let server = StoreServer::start(name, options)?;
            if let Some(tcp) = server.tcp_endpoint() {
                say(format_args!("tcp {tcp}"));
            }
            say(format_args!("ready {}", std::process::id()));
            server.wait(None);
            say("stopped");
            Ok(())
        }
        ("hold", keys) if !keys.is_empty() => {
            let store = connect()?;
            let mut held = Vec::new();
            for key in keys {
                let loaded = store.load(key, Wait::For(std::time::Duration::from_secs(10)))?;
                say(format_args!("held {key} {} {}", loaded.version(), store_data::checksum(&loaded)?));
                held.push(loaded);
            }
            loop {
                std::thread::park();
            }
        }
        ("wait", [key]) => {
            let store = connect()?;
            say("waiting");
            match store.load(key, Wait::Forever) {
                Ok(loaded) => {
                    say(format_args!("loaded {} {}", loaded.version(), store_data::checksum(&loaded)?));
                    Ok(())
                }
                Err(e) => {
                    say(format_args!("error: {e}"));
                    std::process::exit(3);
                }
            }
        }
        ("put", [key, seed]) => {
            let store = connect()?;
            let (td, _) = store_data::state_dict(seed.parse()?);
            store.save(key, &td, None)?;
            say("saved");
            Ok(())
        }
        ("rm-full", [dir]) => {
            let dir = std::path::Path::new(dir);
            let options = || StoreOptions::default().dir(dir.join("store"));
            let keys = |store: &Store| -> Result<String, Failure> {
                let mut keys = store.keys("")?;
                keys.sort();
                Ok(keys.join(","))
            };
            // Stops the server and starts a new one on the same folder, as a restart would.
            let restart = |server: StoreServer| -> Result<StoreServer, Failure> {
                server.stop();
                server.wait(Some(std::time::Duration::from_secs(30)));
                drop(server);
                Ok(StoreServer::start(name, options())?)
            };
            let mut td = tensordict::TensorDict::new(Vec::<usize>::new());
            td.set("x", memmap_tensor::Tensor::from_slice(&[1f32; 256], [256])?)?;
            let server = StoreServer::start(name, options())?;
            let store = connect()?;
            store.save("a", &td, None)?;
            store.save("b", &td, None)?;
            // Fill the filesystem: the next write of the index finds no room.
            let filler = dir.join("filler");
            {
                let mut f = std::fs::File::create(&filler)?;
                let block = vec![7u8; 4096];
                while f.write_all(&block).is_ok() {}
                let _ = f.sync_all();
            }
            match store.remove("a") {
                Ok(found) => say(format!("removed {found}")),
                Err(e) => say(format!("refused: {e}")),
            }
            say(format!("after: {}", keys(&store)?));
            drop(store);
            let server = restart(server)?;
            say(format!("restarted: {}", keys(&connect()?)?));
            std::fs::remove_file(&filler)?;
            let store = connect()?;
            say(format!("removed {}", store.remove("a")?));
            drop(store);
            let _server = restart(server)?;
            say(format!("restarted: {}", keys(&connect()?)?));
            Ok(())
        }
        ("race", [bytes, rounds]) => {
            let server = StoreServer::start(name, StoreOptions::default())?;
            let elements = bytes.parse::<usize>()? / 4;
            let mut td = tensordict::TensorDict::new(Vec::<usize>::new());
            td.set(
                "x",
                memmap_tensor::Tensor::zeros([elements], memmap_tensor::DType::F32, &memmap_tensor::Location::Heap)?,
            )?;
            let stores = [connect()?, connect()?];
            let start = std::sync::Barrier::new(stores.len());
            for _ in 0..rounds.parse::<u32>()? {
                let outcomes: Vec<String> = std::thread::scope(|scope| {
                    let saves: Vec<_> = stores
                        .iter()
                        .enumerate()
                        .map(|(i, store)| {
                            let (start, td) = (&start, &td);
                            scope.spawn(move || {
                                start.wait();
                                match store.save(&format!("k{i}"), td, None) {
                                    Ok(()) => "saved".to_owned(),
                                    Err(e) => format!("refused: {e}"),
                                }
                            })
                        })
                        .collect();
                    saves
                        .into_iter()
                        .map(|s| s.join().unwrap_or_else(|_| "refused: the thread panicked".into()))
                        .collect()
                });
                for outcome in outcomes {
                    say(outcome);
                }
                for key in ["k0", "k1"] {
                    stores[0].remove(key)?;
                }
            }
            drop(stores);
            drop(server);
            say("done");
            Ok(())
        }
        ("mixed", [seed, n]) => {
            let summary = mixed(&connect()?, seed.parse()?, n.parse()?)?;
            say(summary);
            Ok(())
        }
        _ => Err(usage()),
    }
}

/// Mixed operations on keys shared with other clients (`k0`…`k11`) and keys of its own. Every
/// entry read is checked against what its counter says was saved; entries loaded earlier are
/// kept for a while and checked again (holders keep what they mapped, whatever happens to the
/// key meanwhile). Missing keys are fine (another client removed them); any other error or a
/// mismatch fails.
#[cfg(feature = "store")]
fn mixed(store: &tensordict_rpc::store::Store, seed: u64, n: u64) -> Result<String, Failure> {
    use store_data::{Rng, check_mixed, mixed_dict};
    use tensordict_rpc::WireError;
    use tensordict_rpc::store::Wait;

    let mut rng = Rng(seed);
    let missing = |e: &tensordict_rpc::Error| {
        matches!(e, tensordict_rpc::Error::Remote { error: WireError::NotFound { .. }, .. })
    };
    let mut counter = seed << 32;
    let mut held: Vec<(tensordict_rpc::store::Loaded, u64)> = Vec::new();
    let mut counts = [0u64; 8];
    let mut checked = 0u64;
    let mut not_found = 0u64;
    let key = |rng: &mut Rng| {
        if rng.below(3) == 0 { format!("own{seed}-{}", rng.below(4)) } else { format!("k{}", rng.below(12)) }
    };
    for step in 0..n {
        let op = rng.below(8) as usize;
        counts[op] += 1;
        let fail = |what: String| -> Failure { format!("step {step} (op {op}): {what}").into() };
        match op {
            0 => {
                counter += 1;
                let k = key(&mut rng);
                store.save(&k, &mixed_dict(&k, counter), None).map_err(|e| fail(format!("save `{k}`: {e}")))?;
            }
            1 | 2 => {
                let keys: Vec<String> =
                    (0..if op == 1 { 1 } else { 2 + rng.below(2) }).map(|_| key(&mut rng)).collect();
                match store.load_many(&keys, Wait::NOW) {
                    Ok(loaded) => {
                        for (k, l) in keys.iter().zip(loaded) {
                            if l.key() != k {
                                return Err(fail(format!("asked `{k}`, got `{}`", l.key())));
                            }
                            let c = check_mixed(k, &l).map_err(fail)?;
                            checked += 1;
                            if rng.below(4) == 0 {
                                held.push((l, c));
                            }
                        }
                    }
                    Err(e) if missing(&e) => not_found += 1,
                    Err(e) => return Err(fail(format!("load {keys:?}: {e}"))),
                }
            }
            3 => {
                let k = key(&mut rng);
                store.contains(&k).map_err(|e| fail(format!("contains `{k}`: {e}")))?;
            }
            4 => {
                let prefix = if rng.below(2) == 0 { "k".to_owned() } else { format!("own{seed}-") };
                let keys = store.keys(&prefix).map_err(|e| fail(format!("keys `{prefix}`: {e}")))?;
                if keys.iter().any(|k| !k.starts_with(&prefix)) || !keys.is_sorted() {
                    return Err(fail(format!("keys `{prefix}` gave {keys:?}")));
                }
            }
            5 => {
                let k = key(&mut rng);
                store.remove(&k).map_err(|e| fail(format!("remove `{k}`: {e}")))?;
            }
            6 | 7 => {
                counter += 1;
                let k = key(&mut rng);
                let want = mixed_dict(&k, counter);
                let mut allocation = store.allocate(&want).map_err(|e| fail(format!("allocate: {e}")))?;
                for (path, source) in want.leaves() {
                    allocation
                        .get_tensor_mut(path.clone())
                        .and_then(|t| {
                            t.copy_from(source).map_err(|source| tensordict::Error::Tensor { key: path, source })
                        })
                        .map_err(|e| fail(format!("fill: {e}")))?;
                }
                if op == 6 {
                    allocation.seal(&k).map_err(|e| fail(format!("seal `{k}`: {e}")))?;
                } else {
                    drop(allocation);
                }
            }
            _ => unreachable!("op < 8"),
        }
        // Entries held a while still hold what they held when loaded.
        if held.len() > 4 || (!held.is_empty() && rng.below(8) == 0) {
            let (l, c) = held.remove(0);
            let again = check_mixed(l.key(), &l).map_err(|e| fail(format!("held entry: {e}")))?;
            if again != c {
                return Err(fail(format!("held `{}` changed from counter {c} to {again}", l.key())));
            }
            checked += 1;
        }
    }
    Ok(format!(
        "mixed seed={seed} ops={n} saves={} loads={} load_many={} contains={} keys={} removes={} sealed={} dropped={} \
         checked={checked} not_found={not_found}",
        counts[0], counts[1], counts[2], counts[3], counts[4], counts[5], counts[6], counts[7]
    ))
}
