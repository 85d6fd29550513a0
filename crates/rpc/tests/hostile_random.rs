//! Random byte streams after the handshake (a property test): each connection ends, the server
//! serves an honest client after each, and the process's memory stays bounded. Alone in its test
//! binary, so the memory measured is this test's.

mod common;

use std::time::Duration;

use common::{EchoClient, Sandbox, TestResult, name, serve_echo};
use proptest::prelude::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Reads until the server closes the connection; `Err` if it does not within 10 s (a hang guard).
async fn server_closes<S: tokio::io::AsyncRead + Unpin>(stream: &mut S) -> Result<(), String> {
    let mut sink = Vec::new();
    match tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut sink)).await {
        Ok(_) => Ok(()),
        Err(_) => Err("the server kept the connection open".into()),
    }
}

async fn honest_call(endpoint: &tensordict_rpc::Endpoint, options: &tensordict_rpc::ClientOptions) -> TestResult {
    let client: tensordict_rpc::Client<EchoClient> = tensordict_rpc::connect(endpoint, options).await?;
    let back = client.call(async |c, ctx| c.echo(ctx, b"honest".to_vec()).await).await?;
    assert_eq!(back, b"honest");
    Ok(())
}

/// Random byte streams after the handshake (property test): each connection ends, the server
/// serves an honest client after each, and its memory stays bounded.
#[test]
fn random_byte_streams_never_hurt_the_server() -> TestResult {
    let runtime = tokio::runtime::Runtime::new()?;
    let sandbox = Sandbox::new();
    let endpoint = name("random-bytes");
    let (_server, _) = serve_echo(&endpoint, sandbox.server_options())?;
    let options = sandbox.client_options();

    let one_stream = |bytes: &[u8]| -> TestResult {
        runtime.block_on(async {
            let mut stream = tensordict_rpc::connect_stream(&endpoint, &options).await?;
            // The server may close first (on a bad frame): a failed write is fine.
            let _ = stream.write_all(bytes).await;
            let _ = stream.shutdown().await;
            server_closes(&mut stream).await?;
            honest_call(&endpoint, &options).await
        })
    };
    // Warm up the allocator and the runtimes before measuring.
    for _ in 0..20 {
        one_stream(&[0xab; 3000])?;
    }
    let before = common::rss_bytes();

    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: 64,
        failure_persistence: None,
        ..ProptestConfig::default()
    });
    let streams = prop_oneof![
        proptest::collection::vec(any::<u8>(), 0..4096),
        // Streams that start with a plausible length prefix, so the body reaches the decoder.
        (0u32..2048, proptest::collection::vec(any::<u8>(), 0..2048)).prop_map(|(len, body)| [
            &len.to_be_bytes()[..],
            &body
        ]
        .concat()),
    ];
    runner
        .run(&streams, |bytes| {
            one_stream(&bytes).map_err(|e| TestCaseError::fail(e.to_string()))?;
            Ok(())
        })
        .map_err(|e| e.to_string())?;

    let grown = common::rss_bytes().saturating_sub(before);
    assert!(grown < 32 << 20, "the server grew by {grown} bytes over 64 hostile connections");
    Ok(())
}
