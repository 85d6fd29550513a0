//! A Rust actor or learner of a replay service, for tests that pair it with another language:
//!
//! - `replay-peer act NAME RUNTIME_DIR FIRST COUNT`: writes rows `FIRST..FIRST+COUNT` in
//!   batches of 10, each row's `obs` (`f32[8]`) and `action` (`i64`) all holding its value;
//!   prints `done`.
//! - `replay-peer learn NAME RUNTIME_DIR BATCHES BATCH`: samples that many batches and checks
//!   every row is whole (all its values equal); prints one JSON line: rows checked, bad rows,
//!   and the distinct values seen.

use std::collections::BTreeSet;

use anyhow::{Context, bail};
use memmap_tensor::Tensor;
use tensordict::TensorDict;
use tensordict_replay::remote::RemoteBuffer;
use tensordict_rpc::ClientOptions;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [mode, name, runtime, a, b] = args.as_slice() else {
        bail!("usage: replay-peer act|learn NAME RUNTIME_DIR N M");
    };
    let (a, b): (usize, usize) = (a.parse()?, b.parse()?);
    let client = RemoteBuffer::connect_with(name, &ClientOptions::default().runtime_dir(runtime))
        .with_context(|| format!("connecting to {name}"))?;
    match mode.as_str() {
        "act" => {
            for start in (a..a + b).step_by(10) {
                let values: Vec<usize> = (start..(start + 10).min(a + b)).collect();
                client.extend(&rows(&values)?)?;
            }
            println!("done");
        }
        "learn" => {
            let (mut checked, mut bad, mut seen) = (0usize, 0usize, BTreeSet::new());
            for _ in 0..a {
                let (td, _) = client.sample(b, None)?;
                let obs = td.get_tensor("obs")?.to_vec::<f32>()?;
                let action = td.get_tensor("action")?.to_vec::<i64>()?;
                for (k, &v) in action.iter().enumerate() {
                    checked += 1;
                    if obs[k * 8..k * 8 + 8].iter().any(|&x| x as i64 != v) {
                        bad += 1;
                    }
                    seen.insert(v);
                }
            }
            println!("{}", serde_json::json!({"checked": checked, "bad": bad, "values": seen}));
        }
        other => bail!("unknown mode `{other}`"),
    }
    Ok(())
}

fn rows(values: &[usize]) -> anyhow::Result<TensorDict> {
    let n = values.len();
    let mut td = TensorDict::new([n]);
    let obs: Vec<f32> = values.iter().flat_map(|&v| [v as f32; 8]).collect();
    td.set("obs", Tensor::from_slice(&obs, [n, 8])?)?;
    td.set("action", Tensor::from_slice(&values.iter().map(|&v| v as i64).collect::<Vec<_>>(), [n])?)?;
    Ok(td)
}
