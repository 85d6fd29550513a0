//! Who may connect: the TCP token handshake (both ways), token files, the Unix socket peer uid,
//! and the runtime directory checks.

mod common;

use std::io::{Read, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::sync::atomic::Ordering;
use std::time::Duration;

use common::{EchoClient, Sandbox, TestResult, name, serve_echo};
use tensordict_rpc::{BlockingClient, Endpoint, Error, Token};

const MAGIC: &[u8; 8] = b"TDRPC\0v1";

fn tcp_any_port() -> Endpoint {
    "tcp:127.0.0.1:0".parse().expect("endpoint")
}

#[test]
fn a_wrong_token_is_refused_and_the_right_one_is_served() -> TestResult {
    let sandbox = Sandbox::new();
    let token = Token::generate();
    let (server, _) = serve_echo(&tcp_any_port(), sandbox.server_options().token(token.clone()))?;
    let endpoint = server.endpoint().clone();

    let wrong = sandbox.client_options().token(Token::generate());
    let result = BlockingClient::<EchoClient>::connect(&endpoint, &wrong);
    assert!(matches!(result, Err(Error::AuthRefused { .. })), "{result:?}");

    let client: BlockingClient<EchoClient> =
        BlockingClient::connect(&endpoint, &sandbox.client_options().token(token))?;
    assert_eq!(client.call(async |c, ctx| c.echo(ctx, b"t".to_vec()).await)?, b"t");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_tarpc_client_is_not_served() -> TestResult {
    let sandbox = Sandbox::new();
    let (server, echo) = serve_echo(&tcp_any_port(), sandbox.server_options().token(Token::generate()))?;
    let addr = server.local_addr().expect("tcp address");

    let transport = tarpc::serde_transport::tcp::connect(addr, tarpc::tokio_serde::formats::Bincode::default).await?;
    let client = EchoClient::new(tarpc::client::Config::default(), transport).spawn();
    let mut ctx = tarpc::context::current();
    ctx.deadline = std::time::Instant::now() + Duration::from_secs(5);
    let result = client.sleep(ctx, 1).await;
    assert!(result.is_err(), "a client without the handshake was served: {result:?}");
    assert_eq!(echo.sleeps_started.load(Ordering::SeqCst), 0, "a request ran");
    Ok(())
}

/// A fake server that knows no token: it sends a challenge, accepts any proof, answers with a
/// made-up proof, then records whatever the client sends next.
#[test]
fn a_client_never_sends_requests_to_a_server_without_the_token() -> TestResult {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let endpoint: Endpoint = format!("tcp:{}", listener.local_addr()?).parse()?;
    let impostor = std::thread::spawn(move || -> std::io::Result<Vec<u8>> {
        let (mut conn, _) = listener.accept()?;
        conn.set_read_timeout(Some(Duration::from_secs(10)))?;
        let mut hello = MAGIC.to_vec();
        hello.push(1); // challenge
        hello.extend_from_slice(&[9u8; 32]);
        conn.write_all(&hello)?;
        let mut reply = [0u8; 8 + 32 + 32];
        conn.read_exact(&mut reply)?;
        let mut verdict = vec![0u8]; // ok
        verdict.extend_from_slice(&[5u8; 32]); // not a proof of the token
        conn.write_all(&verdict)?;
        let mut after = Vec::new();
        conn.read_to_end(&mut after)?;
        Ok(after)
    });
    let options = Sandbox::new().client_options().token(Token::generate());
    let result = BlockingClient::<EchoClient>::connect(&endpoint, &options);
    assert!(matches!(result, Err(Error::ServerAuthFailed { .. })), "{result:?}");
    drop(result);
    let after = impostor.join().expect("impostor thread")?;
    assert!(after.is_empty(), "the client sent {} bytes to the impostor", after.len());
    Ok(())
}

#[test]
fn a_tcp_server_that_offers_no_challenge_or_speaks_another_protocol_is_refused() -> TestResult {
    for greeting in [[MAGIC.as_slice(), &[0u8]].concat(), b"HTTP/1.1 200 OK\r\n\r\n".to_vec()] {
        let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        let endpoint: Endpoint = format!("tcp:{}", listener.local_addr()?).parse()?;
        let fake = std::thread::spawn(move || -> std::io::Result<()> {
            let (mut conn, _) = listener.accept()?;
            conn.write_all(&greeting)?;
            let mut sink = Vec::new();
            conn.set_read_timeout(Some(Duration::from_secs(10)))?;
            let _ = conn.read_to_end(&mut sink);
            Ok(())
        });
        let options = Sandbox::new().client_options().token(Token::generate());
        let result = BlockingClient::<EchoClient>::connect(&endpoint, &options);
        assert!(matches!(result, Err(Error::Protocol { .. })), "{result:?}");
        drop(result);
        fake.join().expect("fake server")?;
    }
    Ok(())
}

fn write_file(path: &std::path::Path, bytes: &[u8], mode: u32) -> std::io::Result<()> {
    let mut file = std::fs::OpenOptions::new().write(true).create_new(true).mode(mode).open(path)?;
    file.write_all(bytes)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
}

#[test]
fn token_files_are_read_safely() -> TestResult {
    let sandbox = Sandbox::new();
    let dir = sandbox.root.path();

    let (token, good) = sandbox.token_file("good");
    assert_eq!(Token::from_file(&good)?, token, "the trailing newline is not part of the token");

    let open = dir.join("readable");
    write_file(&open, b"0123456789abcdef0123", 0o644)?;
    let err = Token::from_file(&open).unwrap_err();
    assert!(matches!(err, Error::TokenFilePermissions { mode: 0o644, .. }), "{err:?}");
    assert!(err.to_string().contains("chmod 600"), "{err}");

    let short = dir.join("short");
    write_file(&short, b"tiny\n", 0o600)?;
    assert!(matches!(Token::from_file(&short), Err(Error::TokenTooShort { len: 4, .. })));

    let large = dir.join("large");
    write_file(&large, &vec![b'x'; 5000], 0o600)?;
    assert!(matches!(Token::from_file(&large), Err(Error::TokenFileTooLarge { len: 5000, .. })));

    let link = dir.join("link");
    std::os::unix::fs::symlink(&good, &link)?;
    assert!(matches!(Token::from_file(&link), Err(Error::TokenFileIo { .. })), "a symlink was followed");

    let folder = dir.join("folder");
    std::fs::create_dir(&folder)?;
    std::fs::set_permissions(&folder, std::fs::Permissions::from_mode(0o700))?;
    assert!(matches!(Token::from_file(&folder), Err(Error::TokenFileNotRegular { .. })));

    let fifo = dir.join("fifo");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600))?;
    assert!(matches!(Token::from_file(&fifo), Err(Error::TokenFileNotRegular { .. })), "a FIFO was read");

    assert!(matches!(Token::from_file(dir.join("missing")), Err(Error::TokenFileIo { .. })));
    Ok(())
}

#[test]
fn runtime_directory_checks() -> TestResult {
    let sandbox = Sandbox::new();
    let root = sandbox.root.path();
    let endpoint = name("dir-checks");
    let attempt = |dir: &std::path::Path| {
        let served = serve_echo(&endpoint, tensordict_rpc::ServerOptions::default().runtime_dir(dir)).map(|_| ());
        let connected = BlockingClient::<EchoClient>::connect(
            &endpoint,
            &tensordict_rpc::ClientOptions::default().runtime_dir(dir).connect_timeout(Duration::from_millis(100)),
        )
        .map(|_| ());
        (served, connected)
    };

    // Missing: created with mode 0700 (parents too).
    let fresh = root.join("a/b/run");
    let (served, _) = attempt(&fresh);
    served?;
    assert_eq!(std::fs::metadata(&fresh)?.permissions().mode() & 0o777, 0o700);

    let open = root.join("open");
    std::fs::create_dir(&open)?;
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o755))?;
    let (served, connected) = attempt(&open);
    assert!(matches!(served, Err(Error::RuntimeDirMode { mode: 0o755, .. })), "{served:?}");
    assert!(matches!(connected, Err(Error::RuntimeDirMode { .. })), "{connected:?}");

    let private = root.join("private");
    std::fs::create_dir(&private)?;
    std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o700))?;
    let link = root.join("link");
    std::os::unix::fs::symlink(&private, &link)?;
    let (served, connected) = attempt(&link);
    assert!(matches!(served, Err(Error::RuntimeDirSymlink { .. })), "{served:?}");
    assert!(matches!(connected, Err(Error::RuntimeDirSymlink { .. })), "{connected:?}");

    let file = root.join("file");
    std::fs::write(&file, b"")?;
    let (served, _) = attempt(&file);
    assert!(matches!(served, Err(Error::RuntimeDirNotDirectory { .. })), "{served:?}");

    let uid = nix::unistd::geteuid().as_raw();
    if uid == 0 {
        let foreign = root.join("foreign");
        std::fs::create_dir(&foreign)?;
        std::fs::set_permissions(&foreign, std::fs::Permissions::from_mode(0o700))?;
        std::os::unix::fs::chown(&foreign, Some(65534), Some(65534))?;
        let (served, connected) = attempt(&foreign);
        assert!(matches!(served, Err(Error::RuntimeDirOwner { owner: 65534, uid: 0, .. })), "{served:?}");
        assert!(matches!(connected, Err(Error::RuntimeDirOwner { .. })), "{connected:?}");
    } else {
        println!("skipped: a directory of another owner needs root to create (uid {uid})");
    }
    Ok(())
}

/// A process of another uid that reaches the socket (here through a hard link in a directory of
/// its own) is refused by the server; allowed explicitly, it is served.
#[test]
fn a_peer_of_another_uid_is_refused() -> TestResult {
    const NOBODY: u32 = 65534;
    if !nix::unistd::geteuid().is_root() {
        println!("skipped: switching a child to uid {NOBODY} needs root");
        return Ok(());
    }
    let sandbox = Sandbox::new();
    let root = sandbox.root.path();
    std::fs::set_permissions(root, std::fs::Permissions::from_mode(0o755))?;
    // The peer binary, where uid 65534 can run it.
    let binary = root.join("rpc-test-peer");
    std::fs::copy(env!("CARGO_BIN_EXE_rpc-test-peer"), &binary)?;
    std::fs::set_permissions(&binary, std::fs::Permissions::from_mode(0o755))?;
    // The peer's own runtime directory.
    let peer_run = root.join("peer-run");
    std::fs::create_dir(&peer_run)?;
    std::fs::set_permissions(&peer_run, std::fs::Permissions::from_mode(0o700))?;
    std::os::unix::fs::chown(&peer_run, Some(NOBODY), Some(NOBODY))?;

    let run_peer = |endpoint: &Endpoint, trust_root: bool| -> std::io::Result<String> {
        let mut command = std::process::Command::new(&binary);
        command.arg("echo").arg(endpoint.to_string()).env(tensordict_rpc::RUNTIME_DIR_ENV, &peer_run);
        if trust_root {
            command.arg("0");
        }
        std::os::unix::process::CommandExt::uid(&mut command, NOBODY);
        std::os::unix::process::CommandExt::gid(&mut command, NOBODY);
        let output = command.output()?;
        Ok(String::from_utf8_lossy(&output.stdout).trim().to_string())
    };

    for allow in [false, true] {
        let endpoint = name(if allow { "uid-allowed" } else { "uid-refused" });
        let mut options = sandbox.server_options();
        if allow {
            options = options.allow_uid(NOBODY);
        }
        let (server, _) = serve_echo(&endpoint, options)?;
        let socket = server.socket_path().expect("socket");
        std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o777))?;
        let linked = endpoint.socket_path(Some(&sandbox.run_dir()))?.expect("path");
        assert_eq!(linked, socket);
        std::fs::hard_link(socket, peer_run.join(linked.file_name().expect("file name")))?;

        let out = match run_peer(&endpoint, true) {
            Ok(out) => out,
            Err(e) => {
                println!("skipped: cannot start a child as uid {NOBODY}: {e}");
                return Ok(());
            }
        };
        if allow {
            assert_eq!(out, "ok");
        } else {
            assert!(out.starts_with("error: UidRefused") && out.contains("uid: 65534"), "{out}");
            // Without trusting root, the client refuses the server first.
            let out = run_peer(&endpoint, false)?;
            assert!(out.starts_with("error: ServerUid") && out.contains("server_uid: 0"), "{out}");
        }
        std::fs::remove_file(peer_run.join(linked.file_name().expect("file name")))?;
    }
    Ok(())
}
