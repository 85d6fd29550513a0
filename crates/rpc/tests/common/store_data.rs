//! Dicts whose contents any process can rebuild and check: the store tests and the
//! `rpc-test-peer` store modes share this file.
// Each user takes a different subset.
#![allow(dead_code)]

use memmap_tensor::{DType, Tensor};
use tensordict::TensorDict;

/// A small deterministic generator (SplitMix64).
#[derive(Clone, Debug)]
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    /// The next 64 random bits.
    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `0..n`.
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    /// `n` random bytes.
    pub(crate) fn bytes(&mut self, n: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(n + 8);
        while out.len() < n {
            out.extend_from_slice(&self.next().to_le_bytes());
        }
        out.truncate(n);
        out
    }
}

/// FNV-1a of some bytes, continuing from `hash`.
pub(crate) fn fnv(hash: u64, bytes: &[u8]) -> u64 {
    bytes.iter().fold(hash, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
}

const FNV_START: u64 = 0xcbf2_9ce4_8422_2325;

/// A checksum of a dict's values: every leaf's key, dtype, shape and logical bytes, in key order.
pub(crate) fn checksum(td: &TensorDict) -> Result<u64, String> {
    let mut leaves: Vec<(String, &Tensor)> = td.leaves().into_iter().map(|(k, t)| (k.to_string(), t)).collect();
    leaves.sort_by(|a, b| a.0.cmp(&b.0));
    let mut hash = FNV_START;
    for (key, t) in leaves {
        hash = fnv(hash, key.as_bytes());
        hash = fnv(hash, format!("{:?}{:?}", t.dtype(), t.dims()).as_bytes());
        hash = fnv(hash, &t.to_bytes().map_err(|e| format!("`{key}`: {e}"))?);
    }
    Ok(hash)
}

/// The dict the mixed workload saves under `key` for `counter`: its contents derive from both,
/// and `counter` is stored in it, so that any reader can rebuild what it must hold.
pub(crate) fn mixed_dict(key: &str, counter: u64) -> TensorDict {
    let seed = fnv(FNV_START, key.as_bytes()) ^ counter.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let mut rng = Rng(seed);
    let n = 1 + rng.below(40) as usize;
    let mut td = TensorDict::new(Vec::<usize>::new());
    td.set("counter", Tensor::from_slice(&[counter], [1]).expect("counter")).expect("set");
    let a: Vec<f32> = (0..n * 3).map(|_| (rng.below(1 << 20) as f32) / 7.0).collect();
    let a = Tensor::from_slice(&a, [n, 3]).expect("a");
    // A view of `a`: stored once with it in shared memory.
    td.set("a_t", a.permute(&[1, 0]).expect("permute")).expect("set");
    td.set("a", a).expect("set");
    let b: Vec<i64> = (0..6).map(|_| rng.next() as i64).collect();
    td.set(tensordict::KeyPath::new(["nested", "b"]), Tensor::from_slice(&b, [2, 3]).expect("b")).expect("set");
    td
}

/// Checks that `td`, loaded under `key`, is exactly what [`mixed_dict`] made for the counter it
/// holds; returns that counter.
pub(crate) fn check_mixed(key: &str, td: &TensorDict) -> Result<u64, String> {
    let counter = td.get_tensor("counter").map_err(|e| format!("`{key}`: no counter: {e}"))?;
    let counter = counter.to_vec::<u64>().map_err(|e| format!("`{key}`: counter: {e}"))?;
    let [counter] = counter[..] else { return Err(format!("`{key}`: counter has {} values", counter.len())) };
    let want = mixed_dict(key, counter);
    let (got_sum, want_sum) = (checksum(td)?, checksum(&want)?);
    if got_sum != want_sum {
        return Err(format!("`{key}` (counter {counter}): contents differ from what was saved"));
    }
    Ok(counter)
}

/// One tensor of [`state_dict`]: its key, and the key of the tensor it is a view of, if any.
pub(crate) struct Tie {
    /// The view.
    pub(crate) view: String,
    /// The tensor whose storage it views.
    pub(crate) base: String,
}

/// A 100-tensor state dict of varied dtypes and shapes, some leaves views of others (transposes,
/// rows, narrowed ranges, reshapes), with the list of those ties.
pub(crate) fn state_dict(seed: u64) -> (TensorDict, Vec<Tie>) {
    let mut rng = Rng(seed);
    let mut td = TensorDict::new(Vec::<usize>::new());
    let mut ties = Vec::new();
    let mut count = 0;
    let mut layer = 0;
    while count < 100 {
        let dtype = DType::ALL[rng.below(DType::ALL.len() as u64) as usize];
        let shape: Vec<usize> = match rng.below(4) {
            0 => vec![1 + rng.below(64) as usize],
            1 => vec![1 + rng.below(16) as usize, 1 + rng.below(16) as usize],
            2 => vec![2 + rng.below(4) as usize, 2 + rng.below(4) as usize, 1 + rng.below(5) as usize],
            _ => vec![],
        };
        let elems: usize = shape.iter().product();
        let tensor = if dtype == DType::Bool {
            let bools: Vec<bool> = (0..elems).map(|_| rng.below(2) == 1).collect();
            Tensor::from_bools(&bools, shape.clone()).expect("bools")
        } else {
            Tensor::from_bytes(&rng.bytes(elems * dtype.size_in_bytes()), dtype, shape.clone()).expect("bytes")
        };
        let base = format!("layer{layer}.weight");
        td.set(base.as_str(), tensor.clone()).expect("set");
        count += 1;
        // About a third of the tensors get a view of themselves alongside.
        if count < 100 && rng.below(3) == 0 && !shape.is_empty() {
            let view = match shape.len() {
                1 if shape[0] > 2 => tensor.narrow(0, 1, shape[0] - 2).expect("narrow"),
                1 => tensor.reshape(vec![1, shape[0]]).expect("reshape"),
                2 => tensor.permute(&[1, 0]).expect("permute"),
                _ => tensor.select(0, 1).expect("select"),
            };
            let key = format!("layer{layer}.tied");
            td.set(key.as_str(), view).expect("set");
            ties.push(Tie { view: key, base });
            count += 1;
        }
        layer += 1;
    }
    (td, ties)
}
