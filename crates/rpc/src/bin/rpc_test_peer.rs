//! A second process for the crate's tests: serves or calls the test `Echo` service.
//!
//! The runtime directory comes from the environment (`TDICT_RUNTIME_DIR`), as for any program.
//!
//! ```text
//! rpc-test-peer serve ENDPOINT [TOKEN_FILE]     prints the endpoint, then `ready`; serves until killed
//! rpc-test-peer worker ENDPOINT [TOKEN_FILE]    the same with the worker service (`rpc::worker`)
//! rpc-test-peer sleep ENDPOINT MS [TOKEN_FILE]  prints `calling`, calls sleep(MS), prints `done` or `error: …`
//! rpc-test-peer echo ENDPOINT [SERVER_UID]      prints `ok` or `error: …` (exit status 2);
//!                                               SERVER_UID: a server uid to trust besides our own
//! ```

use std::io::Write;
use std::process::ExitCode;

#[path = "../../tests/common/echo.rs"]
mod echo;

use echo::{Echo, EchoClient, EchoServer};
use rpc::worker::Worker;

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

fn token(path: Option<&String>) -> rpc::Result<Option<rpc::Token>> {
    path.map(rpc::Token::from_file).transpose()
}

type Failure = Box<dyn std::error::Error>;

fn run(args: &[String]) -> Result<(), Failure> {
    let usage = || -> Failure {
        format!("usage: serve ENDPOINT [TOKEN_FILE] | sleep ENDPOINT MS [TOKEN_FILE] | echo ENDPOINT [SERVER_UID]; got {args:?}")
            .into()
    };
    let (command, endpoint) = match args {
        [command, endpoint, ..] => (command.as_str(), endpoint.parse::<rpc::Endpoint>()?),
        _ => return Err(usage()),
    };
    match command {
        "serve" => {
            let mut options = rpc::ServerOptions::default();
            options.token = token(args.get(2))?;
            let server = EchoServer { announce: true, ..EchoServer::default() };
            let handle = rpc::serve(&endpoint, server.serve(), options)?;
            println!("{}", handle.endpoint());
            println!("ready");
            std::io::stdout().flush().ok();
            loop {
                std::thread::park();
            }
        }
        "worker" => {
            let mut options = rpc::ServerOptions::default();
            options.token = token(args.get(2))?;
            let handle = rpc::serve(&endpoint, rpc::worker::WorkerServer::new().serve(), options)?;
            println!("{}", handle.endpoint());
            println!("ready");
            std::io::stdout().flush().ok();
            loop {
                std::thread::park();
            }
        }
        "sleep" => {
            let ms: u64 = args.get(2).and_then(|s| s.parse().ok()).ok_or_else(usage)?;
            let mut options = rpc::ClientOptions::default();
            options.token = token(args.get(3))?;
            let client: rpc::BlockingClient<EchoClient> = rpc::BlockingClient::connect(&endpoint, &options)?;
            println!("calling");
            std::io::stdout().flush().ok();
            client.call(async |c, ctx| c.sleep(ctx, ms).await)?;
            println!("done");
            Ok(())
        }
        "echo" => {
            let mut options = rpc::ClientOptions::default().connect_timeout(std::time::Duration::from_secs(2));
            if let Some(uid) = args.get(2) {
                options = options.allow_server_uid(uid.parse()?);
            }
            let client: rpc::BlockingClient<EchoClient> = rpc::BlockingClient::connect(&endpoint, &options)?;
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
