//! The archive `torch.save` writes for a consolidated dict: where its one storage of bytes lies
//! in the file, and the consolidated metadata its pickle carries.
//!
//! `torch.save(td.consolidate(), f)` writes a zip archive whose entries are stored, not
//! compressed: `NAME/data.pkl`, the pickle, and `NAME/data/KEY`, the bytes of each storage, at
//! offsets aligned to 64 bytes. Python tensordict pickles a consolidated dict as
//! `_rebuild_tensordict_files_consolidated(metadata, storage)`, where `metadata` is the same
//! tree of plain values a consolidated file stores as JSON and `storage` is a one-dim `uint8`
//! tensor (`torch._utils._rebuild_tensor_v2` over a persistent storage `KEY`). So the dict's
//! leaves are views of the archive itself: its data is the storage entry's bytes.
//!
//! The pickle is read by a small interpreter of the opcodes such a pickle holds (plain values,
//! globals, calls and persistent ids, up to protocol 5 framing). Nothing is imported or called:
//! globals are names, calls are records, and only the one shape above is accepted. Everything
//! is bounded: the pickle's size, the stack, the memo, and the size and depth of what it
//! builds, so a hostile archive is an error, never a hang or an exhausted memory.

use std::cell::RefCell;
use std::collections::HashMap;
use std::fs::File;
use std::io::Read;
use std::path::Path;
use std::rc::Rc;

use serde_json::{Map, Number, Value};

use crate::{Error, Result};

use super::{MAX_DEPTH, MAX_META_BYTES};

/// The first bytes of a zip archive (a local file header).
pub(super) const ZIP_MAGIC: [u8; 4] = *b"PK\x03\x04";

/// What a `torch.save` archive of a consolidated dict holds: the metadata, and where the
/// storage's bytes are in the file.
pub(super) struct Saved {
    pub(super) meta: Value,
    /// The byte offset of the storage's first byte in the file.
    pub(super) data_start: u64,
    /// Its length in bytes.
    pub(super) data_len: u64,
}

/// Reads the archive `file` (at `path`, `file_len` bytes) as `torch.save` wrote a consolidated
/// dict.
pub(super) fn read(file: &File, path: &Path, file_len: u64) -> Result<Saved> {
    let invalid = |reason: String| Error::InvalidMeta { path: path.to_owned(), reason };
    let zip_err = |e: zip::result::ZipError| invalid(format!("not a torch.save archive that can be read: {e}"));
    let mut archive = zip::ZipArchive::new(file).map_err(zip_err)?;
    // Every entry sits under one folder, named after the file torch.save was given.
    let pickle_name = archive
        .file_names()
        .flatten()
        .find(|name| name.ends_with("/data.pkl") && name.matches('/').count() == 1)
        .map(|name| name.into_owned())
        .ok_or_else(|| invalid("a zip archive without a `NAME/data.pkl`: not written by torch.save".into()))?;
    let prefix = &pickle_name[..pickle_name.len() - "data.pkl".len()];
    if let Some(order) = read_entry(&mut archive, &format!("{prefix}byteorder"), 16, path)?
        && order != b"little"
    {
        return Err(invalid(format!(
            "its tensors are stored {}-endian; only little-endian archives are read",
            String::from_utf8_lossy(&order)
        )));
    }
    let pickle = read_entry(&mut archive, &pickle_name, MAX_META_BYTES, path)?
        .ok_or_else(|| invalid(format!("`{pickle_name}` cannot be read")))?;
    let mut machine = Machine::default();
    let found = machine.run(&pickle).and_then(|top| consolidated_call(&top));
    machine.clear();
    let (meta, storage) = found.map_err(|e| invalid(format!("`{pickle_name}`: {e}")))?;
    let entry_name = format!("{prefix}data/{}", storage.key);
    let entry =
        archive.by_name(&entry_name).map_err(|e| invalid(format!("its storage `{entry_name}` cannot be read: {e}")))?;
    if entry.compression() != zip::CompressionMethod::Stored {
        return Err(invalid(format!("its storage `{entry_name}` is compressed, and cannot be mapped")));
    }
    let entry_start = entry.data_start().ok_or_else(|| invalid(format!("`{entry_name}` has no data offset")))?;
    if storage.numel != entry.size() {
        return Err(invalid(format!(
            "its pickle says storage `{}` holds {} bytes; the archive's entry holds {}",
            storage.key,
            storage.numel,
            entry.size()
        )));
    }
    let end = storage.offset.checked_add(storage.len).filter(|&end| end <= storage.numel).ok_or_else(|| {
        invalid(format!(
            "bytes {}..+{} of its {}-byte storage are outside it",
            storage.offset, storage.len, storage.numel
        ))
    })?;
    let data_start = entry_start + storage.offset;
    if entry_start.checked_add(end).is_none_or(|end| end > file_len) {
        return Err(invalid(format!("its storage `{entry_name}` runs past the end of the file")));
    }
    Ok(Saved { meta, data_start, data_len: storage.len })
}

/// The bytes of the stored entry `name`, at most `max` of them; `None` if there is no such
/// entry.
fn read_entry(archive: &mut zip::ZipArchive<&File>, name: &str, max: u64, path: &Path) -> Result<Option<Vec<u8>>> {
    let invalid = |reason: String| Error::InvalidMeta { path: path.to_owned(), reason };
    let mut entry = match archive.by_name(name) {
        Ok(entry) => entry,
        Err(zip::result::ZipError::FileNotFound) => return Ok(None),
        Err(e) => return Err(invalid(format!("`{name}` cannot be read: {e}"))),
    };
    if entry.size() > max {
        return Err(invalid(format!("`{name}` holds {} bytes, over the limit of {max}", entry.size())));
    }
    let mut bytes = Vec::with_capacity(entry.size() as usize);
    (&mut entry).take(max).read_to_end(&mut bytes).map_err(|e| invalid(format!("`{name}` cannot be read: {e}")))?;
    Ok(Some(bytes))
}

/// What to do with an archive of anything else.
const NOT_CONSOLIDATED: &str =
    "not a consolidated dict (consolidate() it before torch.save, or load it in Python and write it with memmap)";

/// The one-dim byte tensor a consolidated dict's pickle rebuilds its leaves from.
struct StorageView {
    /// The persistent key: the archive holds the bytes at `data/KEY`.
    key: String,
    /// The storage's size in bytes.
    numel: u64,
    /// The tensor's first byte in the storage, and its length.
    offset: u64,
    len: u64,
}

/// The metadata and storage of `_rebuild_tensordict_files_consolidated(metadata, storage)`.
fn consolidated_call(top: &Pv) -> std::result::Result<(Value, StorageView), String> {
    let args = call_of(top, "tensordict._reductions", "_rebuild_tensordict_files_consolidated")
        .ok_or_else(|| format!("it pickles {}: {NOT_CONSOLIDATED}", describe(top)))?;
    let [meta, tensor] = args else {
        return Err(format!("the consolidated dict is rebuilt from {} arguments, not 2", args.len()));
    };
    let meta = to_json(meta, &mut Budget::default(), 0)?;
    let tensor_args = call_of(tensor, "torch._utils", "_rebuild_tensor_v2")
        .ok_or_else(|| format!("its storage is {}, not a tensor", describe(tensor)))?;
    let [Pv::Persistent(id), offset, size, stride, ..] = tensor_args else {
        return Err("its storage tensor is not `(storage, offset, size, stride, ...)`".into());
    };
    let Pv::Tuple(id) = &**id else { return Err("a persistent id that is not a tuple".into()) };
    let [Pv::Str(kind), Pv::Global(class), Pv::Str(key), _location, numel] = &id[..] else {
        return Err("a persistent id that is not `('storage', type, key, location, size)`".into());
    };
    if &**kind != "storage" || class.0 != "torch" || !matches!(class.1.as_str(), "ByteStorage" | "UntypedStorage") {
        return Err(format!("its storage is a `{}.{}`, not bytes", class.0, class.1));
    }
    // The key names an archive entry: keep it to what torch writes (digits).
    if key.is_empty() || key.len() > 20 || !key.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("a storage key {key:?} that torch does not write"));
    }
    let int = |v: &Pv| match v {
        Pv::Int(i) => u64::try_from(*i).ok(),
        _ => None,
    };
    let one = |v: &Pv| match v {
        Pv::Tuple(items) if items.len() == 1 => int(&items[0]),
        _ => None,
    };
    let (Some(numel), Some(offset), Some(len), Some(stride)) = (int(numel), int(offset), one(size), one(stride)) else {
        return Err("its storage tensor is not one-dim, with sizes".into());
    };
    if stride != 1 && len > 1 {
        return Err(format!("its storage tensor steps by {stride} bytes, not 1"));
    }
    Ok((meta, StorageView { key: key.to_string(), numel, offset, len }))
}

/// The arguments of `top` if it is a call of `module.name`.
fn call_of<'a>(top: &'a Pv, module: &str, name: &str) -> Option<&'a [Pv]> {
    let Pv::Call(call) = top else { return None };
    match (&call.0, &call.1) {
        (Pv::Global(g), Pv::Tuple(args)) if g.0 == module && g.1 == name => Some(args),
        _ => None,
    }
}

/// What a pickled value is, for messages.
fn describe(v: &Pv) -> String {
    match v {
        Pv::Call(call) => match &call.0 {
            Pv::Global(g) => format!("a call of `{}.{}`", g.0, g.1),
            _ => "a call".into(),
        },
        Pv::Global(g) => format!("`{}.{}`", g.0, g.1),
        other => format!("a {}", other.kind()),
    }
}

/// How much JSON the metadata may become: shared lists and dicts are written once per use, so
/// a small pickle could otherwise describe an exponential tree.
struct Budget(usize);

impl Default for Budget {
    fn default() -> Self {
        Budget(1 << 20)
    }
}

/// How deep the metadata may nest: two levels per dict (a lazy stack and its dicts), and a
/// leaf's record and shape below the deepest.
const MAX_META_DEPTH: usize = 2 * MAX_DEPTH + 8;

/// The metadata as JSON: dicts of string keys, lists and tuples, strings, numbers, booleans and
/// `None`. Anything else (a global, a call, bytes) is not metadata tensordict writes. (The
/// containers are converted out of line, which keeps each level's stack frame small.)
fn to_json(v: &Pv, budget: &mut Budget, depth: usize) -> std::result::Result<Value, String> {
    if depth > MAX_META_DEPTH {
        return Err(format!("metadata nested deeper than {MAX_META_DEPTH} levels"));
    }
    budget.0 = budget.0.checked_sub(1).ok_or("metadata of more than a million values")?;
    match v {
        Pv::None => Ok(Value::Null),
        Pv::Bool(b) => Ok(Value::Bool(*b)),
        Pv::Int(i) => Ok(Value::Number((*i).into())),
        Pv::Float(f) => Number::from_f64(*f).map(Value::Number).ok_or_else(|| format!("a float {f} in the metadata")),
        Pv::Str(s) => Ok(Value::String(s.to_string())),
        Pv::List(items) => seq_to_json(&items.borrow(), budget, depth),
        Pv::Tuple(items) => seq_to_json(items, budget, depth),
        Pv::Dict(items) => dict_to_json(&items.borrow(), budget, depth),
        other => Err(format!("{} in the metadata", describe(other))),
    }
}

#[inline(never)]
fn seq_to_json(items: &[Pv], budget: &mut Budget, depth: usize) -> std::result::Result<Value, String> {
    let mut out = Vec::with_capacity(items.len());
    for item in items {
        out.push(to_json(item, budget, depth + 1)?);
    }
    Ok(Value::Array(out))
}

#[inline(never)]
fn dict_to_json(items: &[(Pv, Pv)], budget: &mut Budget, depth: usize) -> std::result::Result<Value, String> {
    let mut map = Map::new();
    for (key, value) in items {
        let Pv::Str(key) = key else { return Err(format!("a metadata key that is a {}", key.kind())) };
        if map.insert(key.to_string(), to_json(value, budget, depth + 1)?).is_some() {
            return Err(format!("the metadata key `{key}` twice in one dict"));
        }
    }
    Ok(Value::Object(map))
}

/// A value the pickle built. Lists and dicts are shared and filled in place, as in Python:
/// the memo and the stack hold the same object.
#[derive(Clone)]
enum Pv {
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(Rc<str>),
    /// Bytes: never metadata, so only their place is kept.
    Bytes,
    List(Rc<RefCell<Vec<Pv>>>),
    Tuple(Rc<[Pv]>),
    Dict(Rc<RefCell<Vec<(Pv, Pv)>>>),
    /// `module.name`, as a name: nothing is imported.
    Global(Rc<(String, String)>),
    /// A call of the first value with the second (a tuple): recorded, never made.
    Call(Rc<(Pv, Pv)>),
    /// A persistent id (what `torch.save` refers to a storage by).
    Persistent(Rc<Pv>),
}

impl Pv {
    fn kind(&self) -> &'static str {
        match self {
            Pv::None => "None",
            Pv::Bool(_) => "bool",
            Pv::Int(_) => "int",
            Pv::Float(_) => "float",
            Pv::Str(_) => "str",
            Pv::Bytes => "bytes",
            Pv::List(_) => "list",
            Pv::Tuple(_) => "tuple",
            Pv::Dict(_) => "dict",
            Pv::Global(_) => "global",
            Pv::Call(_) => "call",
            Pv::Persistent(_) => "persistent id",
        }
    }
}

/// The most values the stack and the memo may hold, and the most items a container may.
const MAX_ITEMS: usize = 1 << 20;

/// The pickle virtual machine, for the opcodes a consolidated dict's pickle uses.
#[derive(Default)]
struct Machine {
    stack: Vec<Pv>,
    /// Stack lengths at each MARK.
    marks: Vec<usize>,
    memo: HashMap<u32, Pv>,
    /// Every list and dict made, to empty them when done: a hostile pickle can make one hold
    /// itself, which reference counting alone would never free.
    containers: Vec<Pv>,
}

type Step<T> = std::result::Result<T, String>;

impl Machine {
    /// Empties every list and dict made, so that none outlives the machine.
    fn clear(&mut self) {
        for container in self.containers.drain(..) {
            match container {
                Pv::List(list) => list.borrow_mut().clear(),
                Pv::Dict(dict) => dict.borrow_mut().clear(),
                _ => {}
            }
        }
        self.stack.clear();
        self.memo.clear();
    }

    fn run(&mut self, bytes: &[u8]) -> Step<Pv> {
        let mut at = 0usize;
        let take = |at: &mut usize, n: usize| -> Step<&[u8]> {
            let end = at.checked_add(n).filter(|&end| end <= bytes.len()).ok_or("the pickle ends early")?;
            let out = &bytes[*at..end];
            *at = end;
            Ok(out)
        };
        let uint = |b: &[u8]| b.iter().rev().fold(0u64, |acc, &x| (acc << 8) | u64::from(x));
        loop {
            let op = take(&mut at, 1)?[0];
            match op {
                0x80 => drop(take(&mut at, 1)?),           // PROTO
                0x95 => drop(take(&mut at, 8)?),           // FRAME: the frames are read as one stream
                b'.' => return self.pop(),                 // STOP
                b'(' => self.marks.push(self.stack.len()), // MARK
                b'N' => self.push(Pv::None)?,
                0x88 => self.push(Pv::Bool(true))?,
                0x89 => self.push(Pv::Bool(false))?,
                b'K' => self.push(Pv::Int(take(&mut at, 1)?[0].into()))?,
                b'M' => self.push(Pv::Int(uint(take(&mut at, 2)?) as i64))?,
                b'J' => {
                    self.push(Pv::Int(i32::from_le_bytes(take(&mut at, 4)?.try_into().unwrap_or_default()).into()))?
                }
                0x8a => {
                    // LONG1: a little-endian two's complement integer of n bytes.
                    let n = usize::from(take(&mut at, 1)?[0]);
                    let digits = take(&mut at, n)?;
                    if n > 8 {
                        return Err(format!("an integer of {n} bytes"));
                    }
                    let value = match digits.last() {
                        Some(&last) if last & 0x80 != 0 => {
                            (uint(digits) | (!0u64).checked_shl(8 * n as u32).unwrap_or(0)) as i64
                        }
                        _ => uint(digits) as i64,
                    };
                    if n == 8 && digits[7] & 0x80 == 0 && value < 0 {
                        return Err("an integer over 2**63".into());
                    }
                    self.push(Pv::Int(value))?;
                }
                b'G' => self.push(Pv::Float(f64::from_be_bytes(take(&mut at, 8)?.try_into().unwrap_or_default())))?,
                b'X' | 0x8c | 0x8d => {
                    // BINUNICODE, SHORT_BINUNICODE, BINUNICODE8
                    let width = match op {
                        b'X' => 4,
                        0x8c => 1,
                        _ => 8,
                    };
                    let n = usize::try_from(uint(take(&mut at, width)?)).map_err(|_| "a string too long")?;
                    let text = std::str::from_utf8(take(&mut at, n)?).map_err(|_| "a string that is not UTF-8")?;
                    self.push(Pv::Str(text.into()))?;
                }
                b'C' | b'B' => {
                    // SHORT_BINBYTES, BINBYTES
                    let n = usize::try_from(uint(take(&mut at, if op == b'C' { 1 } else { 4 })?)).unwrap_or(usize::MAX);
                    take(&mut at, n)?;
                    self.push(Pv::Bytes)?;
                }
                b'}' => self.push_container(Pv::Dict(Rc::default()))?,
                b']' => self.push_container(Pv::List(Rc::default()))?,
                b')' => self.push(Pv::Tuple(Rc::new([])))?,
                b't' => {
                    let items = self.pop_mark()?;
                    self.push(Pv::Tuple(items.into()))?;
                }
                0x85..=0x87 => {
                    // TUPLE1..TUPLE3
                    let n = usize::from(op - 0x84);
                    let from = self.stack.len().checked_sub(n).ok_or("a tuple of more values than the stack holds")?;
                    let items: Vec<Pv> = self.stack.drain(from..).collect();
                    self.push(Pv::Tuple(items.into()))?;
                }
                b'l' => {
                    let items = self.pop_mark()?;
                    self.push_container(Pv::List(Rc::new(RefCell::new(items))))?;
                }
                b'd' => {
                    let items = self.pop_mark()?;
                    let dict = Rc::new(RefCell::new(Vec::new()));
                    extend_dict(&dict, items)?;
                    self.push_container(Pv::Dict(dict))?;
                }
                b'a' => {
                    let item = self.pop()?;
                    extend_list(self.top()?, vec![item])?;
                }
                b'e' => {
                    let items = self.pop_mark()?;
                    extend_list(self.top()?, items)?;
                }
                b's' => {
                    let value = self.pop()?;
                    let key = self.pop()?;
                    let Pv::Dict(dict) = self.top()? else {
                        return Err("SETITEM on a value that is not a dict".into());
                    };
                    extend_dict(dict, vec![key, value])?;
                }
                b'u' => {
                    let items = self.pop_mark()?;
                    let Pv::Dict(dict) = self.top()? else {
                        return Err("SETITEMS on a value that is not a dict".into());
                    };
                    extend_dict(dict, items)?;
                }
                b'q' | b'r' => {
                    let key = uint(take(&mut at, if op == b'q' { 1 } else { 4 })?) as u32;
                    self.memoize(key)?;
                }
                0x94 => {
                    let key = u32::try_from(self.memo.len()).map_err(|_| "a memo too large")?;
                    self.memoize(key)?;
                }
                b'h' | b'j' => {
                    let key = uint(take(&mut at, if op == b'h' { 1 } else { 4 })?) as u32;
                    let value =
                        self.memo.get(&key).cloned().ok_or_else(|| format!("memo {key} read before it is written"))?;
                    self.push(value)?;
                }
                b'c' => {
                    let mut line = || -> Step<String> {
                        let rest = &bytes[at..];
                        let n = rest.iter().position(|&b| b == b'\n').ok_or("a global name without its end")?;
                        let text = std::str::from_utf8(&rest[..n]).map_err(|_| "a global name that is not UTF-8")?;
                        at += n + 1;
                        Ok(text.to_owned())
                    };
                    let module = line()?;
                    let name = line()?;
                    self.push(Pv::Global(Rc::new((module, name))))?;
                }
                0x93 => {
                    // STACK_GLOBAL
                    let name = self.pop()?;
                    let module = self.pop()?;
                    let (Pv::Str(module), Pv::Str(name)) = (module, name) else {
                        return Err("a global named by values that are not strings".into());
                    };
                    self.push(Pv::Global(Rc::new((module.to_string(), name.to_string()))))?;
                }
                b'R' => {
                    let args = self.pop()?;
                    let callable = self.pop()?;
                    self.push(Pv::Call(Rc::new((callable, args))))?;
                }
                b'Q' => {
                    let id = self.pop()?;
                    self.push(Pv::Persistent(Rc::new(id)))?;
                }
                other => {
                    return Err(format!(
                        "opcode 0x{other:02x}, which the pickle of a consolidated dict does not use: {NOT_CONSOLIDATED}"
                    ));
                }
            }
        }
    }

    fn push(&mut self, v: Pv) -> Step<()> {
        if self.stack.len() >= MAX_ITEMS {
            return Err("a stack of over a million values".into());
        }
        self.stack.push(v);
        Ok(())
    }

    fn push_container(&mut self, v: Pv) -> Step<()> {
        if self.containers.len() >= MAX_ITEMS {
            return Err("over a million lists and dicts".into());
        }
        self.containers.push(v.clone());
        self.push(v)
    }

    fn pop(&mut self) -> Step<Pv> {
        if self.marks.last().is_some_and(|&mark| mark >= self.stack.len()) {
            return Err("a value taken from below a MARK".into());
        }
        self.stack.pop().ok_or_else(|| "a value taken from an empty stack".into())
    }

    fn top(&self) -> Step<&Pv> {
        self.stack.last().ok_or_else(|| "an empty stack".into())
    }

    /// The values above the last MARK, which is removed.
    fn pop_mark(&mut self) -> Step<Vec<Pv>> {
        let mark = self.marks.pop().ok_or("no MARK to take values up to")?;
        if mark > self.stack.len() {
            return Err("a MARK above the stack".into());
        }
        Ok(self.stack.split_off(mark))
    }

    fn memoize(&mut self, key: u32) -> Step<()> {
        if self.memo.len() >= MAX_ITEMS {
            return Err("a memo of over a million values".into());
        }
        let top = self.top()?.clone();
        self.memo.insert(key, top);
        Ok(())
    }
}

fn extend_list(list: &Pv, items: Vec<Pv>) -> Step<()> {
    let Pv::List(list) = list else { return Err("APPEND to a value that is not a list".into()) };
    let mut list = list.borrow_mut();
    if list.len() + items.len() > MAX_ITEMS {
        return Err("a list of over a million values".into());
    }
    list.extend(items);
    Ok(())
}

/// Adds `items`, keys and values in turn, to `dict` (a later value of a key replaces the
/// earlier, as in Python).
fn extend_dict(dict: &Rc<RefCell<Vec<(Pv, Pv)>>>, items: Vec<Pv>) -> Step<()> {
    if !items.len().is_multiple_of(2) {
        return Err("a dict given a key without its value".into());
    }
    let mut dict = dict.borrow_mut();
    if dict.len() + items.len() / 2 > MAX_ITEMS {
        return Err("a dict of over a million items".into());
    }
    let mut items = items.into_iter();
    while let (Some(key), Some(value)) = (items.next(), items.next()) {
        match (&key, dict.iter_mut().find(|(k, _)| same_key(k, &key))) {
            (_, Some(slot)) => slot.1 = value,
            _ => dict.push((key, value)),
        }
    }
    Ok(())
}

/// Whether two keys are equal strings (the only keys the metadata has; others never match).
fn same_key(a: &Pv, b: &Pv) -> bool {
    matches!((a, b), (Pv::Str(a), Pv::Str(b)) if a == b)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(bytes: &[u8]) -> Step<Pv> {
        Machine::default().run(bytes)
    }

    fn json(bytes: &[u8]) -> Step<Value> {
        let mut machine = Machine::default();
        let json = machine.run(bytes).and_then(|top| to_json(&top, &mut Budget::default(), 0));
        machine.clear();
        json
    }

    #[test]
    fn lists_and_dicts_memoized_empty_are_the_filled_ones() {
        // [d, d] where d = {"a": 1}, memoized before it is filled (as Python's pickler does).
        let pickle = b"\x80\x02]q\x00(}q\x01X\x01\x00\x00\x00aK\x01sh\x01e.";
        assert_eq!(json(pickle).unwrap(), serde_json::json!([{"a": 1}, {"a": 1}]));
    }

    #[test]
    fn integers_of_every_width() {
        let int = |bytes: &[u8]| match run(bytes).unwrap() {
            Pv::Int(i) => i,
            _ => unreachable!("an int"),
        };
        assert_eq!(int(b"K\xff."), 255);
        assert_eq!(int(b"M\x00\x01."), 256);
        assert_eq!(int(b"J\xff\xff\xff\xff."), -1);
        assert_eq!(int(b"\x8a\x01\xff."), -1);
        assert_eq!(int(b"\x8a\x02\x00\x80."), -32768);
        assert_eq!(int(b"\x8a\x08\xff\xff\xff\xff\xff\xff\xff\x7f."), i64::MAX);
        assert!(run(b"\x8a\x08\x00\x00\x00\x00\x00\x00\x00\x80.").is_ok(), "-2**63 fits");
        assert!(run(b"\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x00\x01.").err().unwrap_or_default().contains("9 bytes"));
    }

    #[test]
    fn hostile_pickles_are_errors() {
        let cases: [(&[u8], &str); 8] = [
            (b"", "ends early"),
            (b"X\xff\xff\xff\x7f", "ends early"),
            (b"h\x05.", "before it is written"),
            (b"(a.", "below a MARK"),
            (b"t.", "no MARK"),
            (b"}K\x01s.", "an empty stack"),
            (b"cos\nsystem\n(X\x02\x00\x00\x00lstR\x00", "opcode 0x00"),
            (b"\x92.", "opcode 0x92"),
        ];
        for (bytes, what) in cases {
            let err = run(bytes).err().unwrap_or_default();
            assert!(err.contains(what), "{bytes:?}: {err}");
        }
        // Lists each holding the one before twice: the JSON they would become is capped.
        let mut pickle = b"]q\x00".to_vec();
        for _ in 0..40 {
            pickle.extend_from_slice(b"](h\x00h\x00eq\x00");
        }
        pickle.push(b'.');
        let err = json(&pickle).unwrap_err();
        assert!(err.contains("million"), "{err}");
        // A list holding itself.
        let err = json(b"]q\x00(h\x00e.").unwrap_err();
        assert!(err.contains("deeper"), "{err}");
    }
}
