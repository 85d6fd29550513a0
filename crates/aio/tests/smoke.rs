//! Smoke test of both backends: write, read back, callbacks, futures, vectored, fsync.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use aio::{AlignedBuf, BackendKind, Engine, EngineConfig};

fn engines() -> Vec<Engine> {
    let mut out =
        vec![Engine::with_config(&EngineConfig { backend: Some(BackendKind::Threads), ..Default::default() }).unwrap()];
    match Engine::with_config(&EngineConfig { backend: Some(BackendKind::Uring), ..Default::default() }) {
        Ok(e) => out.push(e),
        Err(e) => eprintln!("io_uring unavailable here: {e}"),
    }
    out
}

#[test]
fn round_trips_on_every_backend() -> std::io::Result<()> {
    for engine in engines() {
        let dir = tempfile::tempdir()?;
        let file =
            Arc::new(std::fs::OpenOptions::new().read(true).write(true).create_new(true).open(dir.path().join("f"))?);
        let data: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        let (n, back) = engine.write_at_blocking(&file, data.clone(), 10);
        assert_eq!(n?, 100_000);
        assert_eq!(back, data);
        let (n, read) = engine.read_at_blocking(&file, Vec::with_capacity(200_000), 10);
        assert_eq!(n?, 100_000, "{:?}: short at EOF", engine.backend());
        assert_eq!(read, data);
        let calls = Arc::new(AtomicUsize::new(0));
        for i in 0..64u64 {
            let calls = Arc::clone(&calls);
            engine.read_at_with(&file, AlignedBuf::new(100)?, 10 + i * 100, move |r, buf| {
                assert_eq!(r.unwrap(), 100);
                assert_eq!(buf.as_slice()[0], ((i * 100) % 251) as u8);
                calls.fetch_add(1, Ordering::SeqCst);
            });
        }
        engine.synchronize();
        assert_eq!(calls.load(Ordering::SeqCst), 64);
        let (n, bufs) = engine.readv_at_blocking(
            &file,
            vec![vec![0u8; 0].into_boxed_slice(), vec![0u8; 10].into_boxed_slice(), vec![0u8; 5].into_boxed_slice()],
            10,
        );
        assert_eq!(n?, 15);
        assert_eq!(&bufs[1][..], &data[..10]);
        engine.fsync_blocking(&file, false)?;
        println!("{:?} ok", engine.backend());
    }
    Ok(())
}
