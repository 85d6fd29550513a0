//! Dicts in named POSIX shared memory: [`TensorDict::share_memory`],
//! [`TensorDict::open_shared`], [`TensorDict::unlink_shared`].
//!
//! Under a prefix `p`, tensor `i` (depth-first order) lives in the shm object `/p.i`, and the
//! schema in `/p.meta`: an 8-byte little-endian length, then JSON `{"version": 1, "root": NODE}`
//! with `NODE` as in the `schema` module, each tensor's `name` being its object. The schema is
//! written last: a reader that finds it finds every tensor.

use memmap_tensor::{Access, DType, Location, Storage, Tensor};
use serde_json::{Value, json};

use crate::error::WithKey;
use crate::schema::{self, Described};
use crate::{Error, KeyPath, MAX_META_BYTES, Result, TensorDict};

const SCHEMA_VERSION: u64 = 1;

impl TensorDict {
    /// Copies every tensor into a new named shared-memory object under `prefix` and returns the
    /// dict backed by them. Another process opens it with [`TensorDict::open_shared`]`(prefix)`
    /// and sees writes made through either handle. The objects stay until
    /// [`TensorDict::unlink_shared`] removes them (shared memory outlives processes).
    ///
    /// `prefix` is a name without `/` (at most 200 bytes). Fails, creating nothing that stays
    /// behind, if anything under `prefix` already exists.
    pub fn share_memory(&self, prefix: &str) -> Result<TensorDict> {
        check_prefix(prefix)?;
        schema::check_limits(self)?;
        let mut created = Vec::new();
        let result = self.share_into(prefix, &mut created);
        if result.is_err() {
            for name in &created {
                // Best effort: these objects were created just now and nobody knows of them.
                let _ = Storage::unlink_shm(name);
            }
        }
        result
    }

    fn share_into(&self, prefix: &str, created: &mut Vec<String>) -> Result<TensorDict> {
        let meta_name = meta_name(prefix);
        if Storage::open_shm(&meta_name, Access::ReadOnly, 0).is_ok() {
            return Err(Error::InvalidArgument { op: "share_memory", detail: format!("`{meta_name}` already exists") });
        }
        let mut counter = 0usize;
        let root = schema::describe(self, &mut |key, t| {
            let name = format!("/{prefix}.{counter}");
            counter += 1;
            let mut out = Tensor::zeros(t.dims(), t.dtype(), &Location::Shm(name.clone())).with_key(|| key.clone())?;
            created.push(name.clone());
            out.copy_from(t).with_key(|| key.clone())?;
            Ok(name)
        })?;
        let text = serde_json::to_vec(&json!({"version": SCHEMA_VERSION, "root": root}))
            .map_err(|e| Error::InvalidArgument { op: "share_memory", detail: format!("schema: {e}") })?;
        let len = u64::try_from(text.len()).unwrap_or(u64::MAX);
        let mut blob =
            Tensor::zeros([8 + text.len()], DType::U8, &Location::Shm(meta_name.clone())).with_key(KeyPath::default)?;
        created.push(meta_name);
        {
            let mut bytes = blob.as_mut_slice::<u8>().with_key(KeyPath::default)?;
            bytes[..8].copy_from_slice(&len.to_le_bytes());
            bytes[8..].copy_from_slice(&text);
        }
        TensorDict::open_shared(prefix, Access::ReadWrite)
    }

    /// Opens the dict shared under `prefix` by [`TensorDict::share_memory`] (in any process).
    /// The schema is validated like a `meta.json` and every object's size is checked before it
    /// is mapped.
    pub fn open_shared(prefix: &str, access: Access) -> Result<TensorDict> {
        check_prefix(prefix)?;
        let schema = read_schema(prefix)?;
        let root = schema.get("root").ok_or_else(|| bad_schema(prefix, "no `root`".into()))?;
        schema::rebuild(
            root,
            &mut |key, Described { dtype, shape, name }| {
                check_leaf_name(name, prefix)?;
                Tensor::open_shm(name, dtype, shape, access).with_key(|| key.clone())
            },
            &|reason| bad_schema(prefix, reason),
        )
    }

    /// Removes every shared-memory object of the dict shared under `prefix`. Processes that
    /// mapped them keep their mappings until they drop them.
    pub fn unlink_shared(prefix: &str) -> Result<()> {
        check_prefix(prefix)?;
        let schema = read_schema(prefix)?;
        let mut names = Vec::new();
        if let Some(root) = schema.get("root") {
            schema::names(root, &mut names);
        }
        for name in names {
            check_leaf_name(&name, prefix)?;
            match Storage::unlink_shm(&name) {
                Ok(()) | Err(memmap_tensor::Error::ShmIo { .. }) => {}
                Err(e) => return Err(Error::Tensor { key: KeyPath::default(), source: e }),
            }
        }
        Storage::unlink_shm(&meta_name(prefix)).with_key(KeyPath::default)
    }
}

fn read_schema(prefix: &str) -> Result<Value> {
    let name = meta_name(prefix);
    let header = Tensor::open_shm(&name, DType::U8, [8], Access::ReadOnly).with_key(KeyPath::default)?;
    let len_bytes: [u8; 8] = header.to_vec::<u8>().with_key(KeyPath::default)?.try_into().unwrap_or_default();
    let len = u64::from_le_bytes(len_bytes);
    if len > MAX_META_BYTES {
        return Err(bad_schema(prefix, format!("schema of {len} bytes is over the limit")));
    }
    let len = usize::try_from(len).map_err(|_| bad_schema(prefix, "schema length overflows".into()))?;
    let blob = Tensor::open_shm(&name, DType::U8, [8 + len], Access::ReadOnly).with_key(KeyPath::default)?;
    let bytes = blob.to_vec::<u8>().with_key(KeyPath::default)?;
    let schema = schema::parse_bounded(&bytes[8..], schema::MAX_SCHEMA_JSON_DEPTH)
        .map_err(|e| bad_schema(prefix, format!("invalid JSON: {e}")))?;
    match schema.get("version").and_then(Value::as_u64) {
        Some(SCHEMA_VERSION) => Ok(schema),
        other => Err(bad_schema(prefix, format!("unsupported schema version {other:?}"))),
    }
}

fn meta_name(prefix: &str) -> String {
    format!("/{prefix}.meta")
}

/// Leaf names must be `/<prefix>.<number>`: a schema cannot point at other objects.
fn check_leaf_name(name: &str, prefix: &str) -> Result<()> {
    let ok = name
        .strip_prefix('/')
        .and_then(|n| n.strip_prefix(prefix))
        .and_then(|n| n.strip_prefix('.'))
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
    if ok { Ok(()) } else { Err(bad_schema(prefix, format!("object name `{name}` is not one of this prefix"))) }
}

fn check_prefix(prefix: &str) -> Result<()> {
    if prefix.is_empty() || prefix.len() > 200 || prefix.contains('/') || prefix.contains('\0') {
        return Err(Error::InvalidArgument {
            op: "shared memory",
            detail: format!("prefix `{prefix}` must be 1 to 200 bytes without `/` or NUL"),
        });
    }
    Ok(())
}

fn bad_schema(prefix: &str, reason: String) -> Error {
    Error::InvalidMeta { path: format!("shm:/{prefix}.meta").into(), reason }
}
