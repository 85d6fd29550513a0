//! The store served over TCP: entries saved on one host load whole on another.

use super::*;

/// The dict a client saves under a seed: every value derived from the seed.
pub(crate) fn seeded(seed: i64) -> anyhow::Result<TensorDict> {
    let rows = 32;
    let mut td = TensorDict::new([rows]);
    let w: Vec<f32> = (0..rows * WIDTH).map(|i| (seed * 10_000 + i as i64) as f32).collect();
    let b: Vec<i64> = (0..rows).map(|i| seed * 1_000_000 + i as i64).collect();
    td.set(["layer", "weight"], Tensor::from_slice(&w, [rows, WIDTH])?)?;
    td.set(["layer", "bias"], Tensor::from_slice(&b, [rows])?)?;
    Ok(td)
}

pub(crate) fn same(got: &TensorDict, want: &TensorDict) -> anyhow::Result<()> {
    for key in [["layer", "weight"], ["layer", "bias"]] {
        let name = key.join(".");
        let g = got.get_tensor(key)?;
        let w = want.get_tensor(key)?;
        ensure!(g.dims() == w.dims() && g.dtype() == w.dtype(), "`{name}` is {:?} {:?}", g.dtype(), g.dims());
        let (g, w) = (g.contiguous()?.to_bytes()?, w.contiguous()?.to_bytes()?);
        if g != w {
            let first = g.iter().zip(&w).position(|(a, b)| a != b).unwrap_or(0);
            bail!("`{name}` differs from what was saved from byte {first} on");
        }
    }
    Ok(())
}

pub(crate) fn store_save((endpoint, options): &(Endpoint, ClientOptions), key: &str, seed: i64) -> anyhow::Result<()> {
    let store = Store::connect_to(endpoint, options).with_context(|| format!("connecting to {endpoint}"))?;
    store.save(key, &seeded(seed)?, None).with_context(|| format!("saving `{key}`"))?;
    println!("{}: saved `{key}` (seed {seed}) through {endpoint}", host());
    Ok(())
}

/// Loads `key` and checks it is the dict of `seed`: mapped, or `by_value` copied from the
/// store's memory over the connection (what a client on another machine does; the test hosts
/// share one kernel and `/dev/shm`, so they count as one node and must ask).
pub(crate) fn store_load(
    (endpoint, options): &(Endpoint, ClientOptions),
    key: &str,
    seed: i64,
    by_value: bool,
) -> anyhow::Result<()> {
    let store =
        Store::connect_to(endpoint, options).with_context(|| format!("connecting to {endpoint}"))?.by_value(by_value);
    let loaded = store.load(key, Duration::from_secs(20)).with_context(|| format!("loading `{key}`"))?;
    same(&loaded, &seeded(seed)?).with_context(|| format!("`{key}` as loaded on {}", host()))?;
    let how = if by_value { "by value" } else { "mapped" };
    println!(
        "{}: loaded `{key}` (version {}, {how}) through {endpoint}: every value is the saver's",
        host(),
        loaded.version()
    );
    Ok(())
}

pub(crate) fn store_refused(endpoint: &str) -> anyhow::Result<()> {
    let endpoint: Endpoint = endpoint.parse()?;
    let token = Token::from_bytes(b"not-the-token-of-this-store".to_vec())?;
    let options = ClientOptions::default().token(token).connect_timeout(Duration::from_secs(10));
    match Store::connect_to(&endpoint, &options) {
        Ok(store) => match store.keys("") {
            Ok(keys) => bail!("a client with a wrong token was served (keys {keys:?})"),
            Err(e) => println!("{}: wrong token refused at the first call: {e}", host()),
        },
        Err(e) => println!("{}: wrong token refused: {e}", host()),
    }
    Ok(())
}
