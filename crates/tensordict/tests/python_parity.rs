//! Behaviour checked against Python tensordict 0.15.3, from the fixtures that
//! `tools/python/make_parity.py` wrote into `tests/fixtures/parity/`: a table of index
//! expressions (reads and writes, errors included), non-tensor values Python writes in its own
//! way (NaN, infinities, big integers, float notations), and non-tensor stacks over two batch
//! dims with the folders Python writes after batch operations on them.

use std::fs;
use std::path::{Path, PathBuf};

use memmap_tensor::{Access, DType, Location, Tensor};
use serde_json::{Value, json};
use tensordict::{Entry, Error, Index, TensorDict, json_as_f64, json_float};

mod common;
use common::TestResult;
type AnyResult<T> = Result<T, Box<dyn std::error::Error>>;

fn parity_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/parity")
}

// === Indexing ===

/// The shape and C-order values of a nested JSON list.
fn flatten(v: &Value, shape: &mut Vec<usize>, out: &mut Vec<Value>, depth: usize) {
    match v.as_array() {
        Some(items) => {
            if shape.len() == depth {
                shape.push(items.len());
            }
            for item in items {
                flatten(item, shape, out, depth + 1);
            }
        }
        None => out.push(v.clone()),
    }
}

fn nested(v: &Value) -> (Vec<usize>, Vec<Value>) {
    let (mut shape, mut out) = (Vec::new(), Vec::new());
    flatten(v, &mut shape, &mut out, 0);
    (shape, out)
}

/// One index item of the table: `{"int"}`, `{"slice"}`, `{"list"}`, `{"mask"}`, `"..."`, null.
fn item(v: &Value) -> Index {
    match v {
        Value::Null => Index::NewDim,
        Value::String(s) if s == "..." => Index::Ellipsis,
        Value::Object(o) if o.contains_key("int") => Index::Int(o["int"].as_i64().unwrap()),
        Value::Object(o) if o.contains_key("slice") => {
            let s = o["slice"].as_array().unwrap();
            Index::slice(s[0].as_i64(), s[1].as_i64(), s[2].as_i64().unwrap_or(1))
        }
        Value::Object(o) if o.contains_key("list") => {
            let (shape, values) = nested(&o["list"]);
            let indices: Vec<i64> = values.iter().map(|v| v.as_i64().unwrap()).collect();
            if shape.len() == 1 { Index::List(indices) } else { Index::ListNd { indices, shape } }
        }
        Value::Object(o) if o.contains_key("mask") => {
            let (shape, values) = nested(&o["mask"]);
            let mask: Vec<bool> = values.iter().map(|v| v.as_bool().unwrap()).collect();
            if shape.len() == 1 { Index::Mask(mask) } else { Index::MaskNd { mask, shape } }
        }
        other => panic!("unknown index item {other}"),
    }
}

fn arange(dims: &[usize], negate: bool) -> AnyResult<Tensor> {
    let n: usize = dims.iter().product();
    let values: Vec<i64> = (0..n as i64).map(|i| if negate { -1 - i } else { i }).collect();
    Ok(Tensor::from_slice(&values, dims.to_vec())?)
}

fn table_dict(batch: &[usize]) -> AnyResult<TensorDict> {
    let mut td = TensorDict::new(batch);
    td.set("a", arange(batch, false)?)?;
    td.set("b", arange(&[batch, &[2]].concat(), false)?)?;
    // A stack over the batch moves with the rows as `a` does.
    let positions: Vec<Value> = (0..batch.iter().product::<usize>()).map(|i| json!(i)).collect();
    td.set("names", stack_of(&positions, batch))?;
    Ok(td)
}

/// A non-tensor stack of shape `shape` holding `values` in C order.
fn stack_of(values: &[Value], shape: &[usize]) -> Entry {
    fn nest(values: &[Value], shape: &[usize]) -> Value {
        match shape.split_first() {
            None => values[0].clone(),
            Some((&n, rest)) => {
                let inner: usize = rest.iter().product();
                Value::Array((0..n).map(|i| nest(&values[i * inner..(i + 1) * inner], rest)).collect())
            }
        }
    }
    Entry::NonTensorStack(nest(values, shape))
}

#[test]
fn index_expressions_match_python() -> TestResult {
    let table: Value = serde_json::from_slice(&fs::read(parity_dir().join("indexing.json"))?)?;
    let mut checked = 0;
    for (name, batch) in [("batch_34", vec![3, 4]), ("batch_2345", vec![2, 3, 4, 5])] {
        for row in table[name].as_array().unwrap() {
            let index = Index::Tuple(row["index"].as_array().unwrap().iter().map(item).collect());
            let td = table_dict(&batch)?;
            let got = td.index(index.clone());
            if let Some(err) = row.get("error") {
                assert!(matches!(got, Err(Error::InvalidIndex { .. })), "{index}: Python says {err}, we give {got:?}");
                checked += 1;
                continue;
            }
            let got = got.map_err(|e| format!("{index}: {e}"))?;
            let expected_batch: Vec<usize> = serde_json::from_value(row["batch_size"].clone())?;
            assert_eq!(got.batch_size(), expected_batch, "{index}");
            let a: Vec<i64> = serde_json::from_value(row["a"].clone())?;
            assert_eq!(got.get_tensor("a")?.contiguous()?.to_vec::<i64>()?, a, "{index}");
            let b_shape: Vec<usize> = serde_json::from_value(row["b_shape"].clone())?;
            assert_eq!(got.get_tensor("b")?.dims(), b_shape, "{index}");
            // The stack picked the same positions as `a`.
            match got.get("names")? {
                Entry::NonTensor(v) => assert_eq!(vec![v.as_i64().unwrap()], a, "{index}"),
                Entry::NonTensorStack(v) => {
                    let (_, values) = nested(v);
                    let values: Vec<i64> = values.iter().map(|v| v.as_i64().unwrap()).collect();
                    if !a.is_empty() {
                        assert_eq!(values, a, "{index}");
                    }
                }
                other => panic!("{index}: {}", other.kind_name()),
            }
            // The write: `td[index] = -1 - arange` over the result's shape.
            let mut target = table_dict(&batch)?;
            let mut src = TensorDict::new(got.batch_size());
            src.set("a", arange(got.get_tensor("a")?.dims(), true)?)?;
            src.set("b", arange(got.get_tensor("b")?.dims(), true)?)?;
            let written = target.set_at(index.clone(), &src);
            match row.get("a_after_write") {
                Some(after) => {
                    written.map_err(|e| format!("{index}: {e}"))?;
                    let after: Vec<i64> = serde_json::from_value(after.clone())?;
                    assert_eq!(target.get_tensor("a")?.to_vec::<i64>()?, after, "write {index}");
                }
                None => assert!(written.is_err(), "write {index}: Python fails with {}", row["write_error"]),
            }
            checked += 1;
        }
    }
    assert!(checked >= 40, "only {checked} cases");
    Ok(())
}

// === Non-tensor JSON values ===

/// Every `meta.json` under `dir`, by relative path.
fn metas(dir: &Path) -> AnyResult<Vec<(PathBuf, Vec<u8>)>> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_owned()];
    while let Some(d) = stack.pop() {
        for entry in fs::read_dir(&d)? {
            let path = entry?.path();
            if path.is_dir() {
                stack.push(path);
            } else if path.file_name() == Some("meta.json".as_ref()) {
                out.push((path.strip_prefix(dir)?.to_owned(), fs::read(&path)?));
            }
        }
    }
    out.sort();
    Ok(out)
}

/// Compares every `meta.json` byte for byte, except that a stack's `stack_dim` is 0 in ours:
/// Python writes the dim a stack was built along but reads every stack as nested lists in batch
/// order with `stack_dim` 0 (and so writes 0 after a load), and our stacks have no such dim.
fn assert_same_metas(ours: &Path, python: &Path) -> TestResult {
    let (a, mut b) = (metas(ours)?, metas(python)?);
    for (_, text) in &mut b {
        let normalized = String::from_utf8(text.clone())?.replacen(r#""stack_dim":1,"#, r#""stack_dim":0,"#, 1);
        *text = normalized.into_bytes();
    }
    assert_eq!(a.iter().map(|m| &m.0).collect::<Vec<_>>(), b.iter().map(|m| &m.0).collect::<Vec<_>>());
    for ((path, mine), (_, theirs)) in a.iter().zip(&b) {
        assert_eq!(
            String::from_utf8_lossy(mine),
            String::from_utf8_lossy(theirs),
            "{} differs from Python's {}",
            path.display(),
            python.display()
        );
    }
    Ok(())
}

#[test]
fn nan_infinity_and_big_integers_read_and_written_back_as_python_wrote_them() -> TestResult {
    let source = parity_dir().join("special_values");
    let td = TensorDict::load_memmap(&source, Access::ReadOnly)?;
    assert!(json_as_f64(td.get_non_tensor("nan")?).unwrap().is_nan());
    assert_eq!(json_as_f64(td.get_non_tensor("inf")?), Some(f64::INFINITY));
    assert_eq!(json_as_f64(td.get_non_tensor("ninf")?), Some(f64::NEG_INFINITY));
    assert_eq!(td.get_non_tensor("big")?.to_string(), "1180591620717411303425");
    assert_eq!(td.get_non_tensor("neg_big")?.to_string(), "-1208925819614629174706176");
    assert!(json_as_f64(&td.get_non_tensor("mixed")?["nan"][0]).unwrap().is_nan());
    assert_eq!(td.get_non_tensor("mixed")?["s"], "NaN");
    let dir = tempfile::tempdir()?;
    td.memmap(dir.path().join("copy"))?;
    assert_same_metas(&dir.path().join("copy"), &source)?;
    Ok(())
}

#[test]
fn non_finite_floats_set_from_rust_are_written_as_python_writes_them() -> TestResult {
    let mut td = TensorDict::new([2]);
    td.set("v", json!([json_float(f64::NAN), json_float(f64::INFINITY), json_float(-1.5e300), json_float(1e-5)]))?;
    let dir = tempfile::tempdir()?;
    let back = td.memmap(dir.path().join("td"))?;
    let meta = fs::read_to_string(dir.path().join("td/v/meta.json"))?;
    assert!(meta.contains(r#""data": [NaN, Infinity, -1.5e+300, 1e-05]"#), "{meta}");
    // Numbers keep their text (`arbitrary_precision`), so compare them as floats: `1e-05`
    // read back is the number `json_float(1e-5)` made as `0.00001`.
    let floats = |v: &Value| -> Vec<String> {
        v.as_array().unwrap().iter().map(|x| format!("{:?}", json_as_f64(x).unwrap())).collect()
    };
    assert_eq!(floats(back.get_non_tensor("v")?), ["NaN", "inf", "-1.5e300", "1e-5"]);
    Ok(())
}

// === Non-tensor stacks over two batch dims ===

fn python_folder(name: &str) -> PathBuf {
    parity_dir().join(name)
}

fn python_view(name: &str) -> AnyResult<Value> {
    Ok(serde_json::from_slice(&fs::read(parity_dir().join(format!("{name}.python.json")))?)?)
}

#[test]
fn a_stack_over_two_batch_dims_is_read_and_indexed_as_in_python() -> TestResult {
    let td = TensorDict::load_memmap(python_folder("stack_2d"), Access::ReadOnly)?;
    assert_eq!(python_view("stack_2d")?["non_tensor"]["names"]["batch_size"], json!([3, 4]));
    let names = td.get_non_tensor("names")?;
    assert_eq!(names[2][1], "21");
    // td[:, 1] (Python: ['01', '11', '21']), td[mask] (['01', '23']), td[1, 2] ('12').
    assert_eq!(td.index((Index::full(), 1i64))?.get_non_tensor("names")?, &json!(["01", "11", "21"]));
    let mut mask = vec![false; 12];
    mask[1] = true;
    mask[11] = true;
    let picked = td.index(Index::MaskNd { mask, shape: vec![3, 4] })?;
    assert_eq!(picked.get_non_tensor("names")?, &json!(["01", "23"]));
    assert!(matches!(td.index((1i64, 2i64))?.get("names")?, Entry::NonTensor(v) if v == "12"));
    Ok(())
}

#[test]
fn batch_operations_on_stacks_write_the_folders_python_writes() -> TestResult {
    let td = TensorDict::load_memmap(python_folder("stack_2d"), Access::ReadOnly)?;
    let tmp = tempfile::tempdir()?;
    // `PARITY_OUT=dir` keeps the folders there, for `tools/python/check_folder.py`.
    let out_dir = std::env::var_os("PARITY_OUT").map_or_else(|| tmp.path().to_owned(), PathBuf::from);
    let cases = [
        ("stack_2d", td.clone()),
        ("stack_2d_unsqueeze1", td.unsqueeze(1)?),
        ("stack_2d_stack1", TensorDict::stack(&[&td, &td], 1)?),
        ("stack_2d_reshape12", td.reshape(&[12])?),
    ];
    for (name, out) in cases {
        let path = out_dir.join(name);
        out.memmap(&path)?;
        assert_same_metas(&path, &python_folder(name))?;
    }
    Ok(())
}

fn valued(v: &str, fill: f32) -> AnyResult<TensorDict> {
    let mut td = TensorDict::new([2]);
    let x = Tensor::zeros([2], DType::F32, &Location::Heap)?;
    let mut x = x;
    x.as_mut_slice::<f32>()?.fill(fill);
    td.set("x", x)?;
    td.set("s", json!(v))?;
    Ok(td)
}

#[test]
fn stacking_and_concatenating_values_makes_what_python_makes() -> TestResult {
    let (a, b) = (valued("a", 0.0)?, valued("b", 1.0)?);
    let dir = tempfile::tempdir()?;
    let cases = [
        ("stacked_values", TensorDict::stack(&[&a, &b], 0)?),
        ("stacked_equal_values", TensorDict::stack(&[&a, &a], 0)?),
        ("cat_values", TensorDict::cat(&[&a, &b], 0)?),
        ("cat_equal_values", TensorDict::cat(&[&a, &a], 0)?),
    ];
    for (name, out) in cases {
        let path = dir.path().join(name);
        out.memmap(&path)?;
        assert_same_metas(&path, &python_folder(name))?;
        let kind = python_view(name)?["non_tensor"]["s"]["type"].clone();
        let ours = match out.get("s")? {
            Entry::NonTensor(_) => "NonTensorData",
            Entry::NonTensorStack(_) => "NonTensorStack",
            other => other.kind_name(),
        };
        assert_eq!(kind, ours, "{name}");
    }
    Ok(())
}

#[test]
fn memmap_like_with_a_new_first_dim_repeats_the_first_row_of_stacks() -> TestResult {
    let td = TensorDict::load_memmap(python_folder("stack_2d"), Access::ReadOnly)?;
    let dir = tempfile::tempdir()?;
    let like = td.memmap_like(dir.path().join("like"), Some(5))?;
    assert_eq!(like.batch_size(), &[5, 4]);
    let row0 = td.get_non_tensor("names")?[0].clone();
    assert_eq!(like.get_non_tensor("names")?, &json!(vec![row0; 5]));
    // Same size: the values as they are (Python's memmap_like keeps them).
    let same = td.memmap_like(dir.path().join("same"), None)?;
    assert_eq!(same.get_non_tensor("names")?, td.get_non_tensor("names")?);
    // No rows to repeat: a clear error, nothing half written.
    let empty = td.index(Index::List(vec![]))?;
    match empty.memmap_like(dir.path().join("empty"), Some(3)) {
        Err(Error::InvalidArgument { detail, .. }) => assert!(detail.contains("names"), "{detail}"),
        other => panic!("{other:?}"),
    }
    assert!(!dir.path().join("empty/meta.json").exists());
    Ok(())
}

// === chunk and squeeze ===

#[test]
fn chunk_of_an_empty_dim_gives_every_chunk_and_squeeze_keeps_other_sizes() -> TestResult {
    // Python: TensorDict(batch [0, 3]).chunk(n, 0) gives n dicts of batch [0, 3].
    let mut td = TensorDict::new([0, 3]);
    td.set("a", Tensor::zeros([0, 3], DType::F32, &Location::Heap)?)?;
    for n in [1, 2, 3, 5] {
        let parts = td.chunk(n, 0)?;
        assert_eq!(parts.len(), n);
        assert!(parts.iter().all(|p| p.batch_size() == [0, 3]));
    }
    // Python: TensorDict(batch [5, 3]).chunk(4, 0) sizes 2, 2, 1; squeeze(0) keeps [5, 3].
    let mut five = TensorDict::new([5, 3]);
    five.set("a", Tensor::zeros([5, 3], DType::F32, &Location::Heap)?)?;
    let sizes: Vec<usize> = five.chunk(4, 0)?.iter().map(|p| p.batch_size()[0]).collect();
    assert_eq!(sizes, [2, 2, 1]);
    assert_eq!(five.squeeze(0)?.batch_size(), &[5, 3]);
    assert!(matches!(five.squeeze(2), Err(Error::InvalidArgument { .. })));
    Ok(())
}

// === Assignments (`td[index] = value`) ===

/// A tensor of the assignment table: `{"dtype", "shape", "values"}` (values as JSON numbers).
fn table_tensor(v: &Value) -> AnyResult<Tensor> {
    let values: Vec<f64> = v["values"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
    let shape: Vec<usize> = serde_json::from_value(v["shape"].clone())?;
    let dtype: DType = v["dtype"].as_str().unwrap().parse()?;
    Ok(Tensor::from_slice(&values, shape)?.to_dtype(dtype)?)
}

/// The entries of a table value (`{name: tensor or nested entries}`) set into `td`.
fn table_entries(td: &mut TensorDict, prefix: &[String], entries: &Value) -> TestResult {
    for (name, v) in entries.as_object().unwrap() {
        let path: Vec<String> = prefix.iter().cloned().chain([name.clone()]).collect();
        if v.get("dtype").is_some() {
            td.set(path, table_tensor(v)?)?;
        } else {
            table_entries(td, &path, v)?;
        }
    }
    Ok(())
}

/// The dict every assignment of the table writes into.
fn assignment_base() -> AnyResult<TensorDict> {
    let range = |n: usize, dims: &[usize], dtype: DType| -> AnyResult<Tensor> {
        Ok(Tensor::from_slice(&(0..n).map(|i| i as f64).collect::<Vec<_>>(), dims.to_vec())?.to_dtype(dtype)?)
    };
    let mut td = TensorDict::new([3, 4]);
    td.set("a", range(24, &[3, 4, 2], DType::F32)?)?;
    td.set("b", range(12, &[3, 4], DType::I64)?)?;
    td.set(["n", "c"], range(36, &[3, 4, 3], DType::F32)?)?;
    Ok(td)
}

/// `td[index] = value` of `tests/fixtures/parity/assignments.json` (`make_parity_writes.py`)
/// through [`TensorDict::assign_at`] (dicts) and [`TensorDict::fill_at`] (numbers and single
/// tensors): every leaf afterwards as Python tensordict left it, or an error where Python
/// raised one, with nothing written. (The table's other writes, by key, are Python's own API and
/// are checked from Python, as is the lock.) A value of a batch size that is neither the indexed
/// one nor its last dims is given the indexed one first, when its tensors allow
/// ([`TensorDict::set_batch_size`]), as Python does and the Python binding does.
#[test]
fn assignments_by_index_match_python() -> TestResult {
    let table: Value = serde_json::from_slice(&fs::read(parity_dir().join("assignments.json"))?)?;
    let mut checked = 0;
    for case in table["cases"].as_array().unwrap() {
        // A locked dict is Python's API, checked from Python.
        if case["op"] != "setitem_index" || case.get("locked").is_some() {
            continue;
        }
        let index = Index::Tuple(case["index"].as_array().unwrap().iter().map(item).collect());
        let mut td = assignment_base()?;
        let value = &case["value"];
        let outcome = if let Some(n) = value.get("number") {
            let scalar = match n {
                Value::Bool(b) => Tensor::from_bools(&[*b], Vec::<usize>::new())?,
                n if n.is_i64() => Tensor::from_slice(&[n.as_i64().unwrap()], Vec::<usize>::new())?,
                n => Tensor::from_slice(&[n.as_f64().unwrap()], Vec::<usize>::new())?,
            };
            td.fill_at(index.clone(), &scalar)
        } else if let Some(t) = value.get("tensor") {
            td.fill_at(index.clone(), &table_tensor(t)?)
        } else {
            let entries = value.get("dict").or(value.get("td")).unwrap();
            let want = td.index_shape(&index).ok();
            let batch = match value.get("batch_size") {
                Some(b) => serde_json::from_value(b.clone())?,
                None => want.clone().unwrap_or_default(),
            };
            let mut src = TensorDict::new(batch.clone());
            match table_entries(&mut src, &[], entries) {
                Ok(()) => {
                    // What Python does before it writes: a batch size that is neither the indexed
                    // one nor its last dims (which `assign_at` repeats) is set to the indexed one
                    // when the tensors allow.
                    if let Some(want) = want
                        && batch != want
                        && (batch.is_empty() || batch.len() >= want.len() || !want.ends_with(&batch))
                    {
                        let _ = src.set_batch_size(want);
                    }
                    td.assign_at(index.clone(), &src)
                }
                Err(e) => Err(Error::InvalidArgument { op: "table value", detail: e.to_string() }),
            }
        };
        let expected = &case["result"];
        match (outcome, expected.get("error")) {
            (Err(_), Some(_)) => {
                let untouched = assignment_base()?;
                for (key, t) in untouched.leaves() {
                    assert_eq!(
                        td.get_tensor(&key)?.to_bytes()?,
                        t.to_bytes()?,
                        "{index}: a refused write wrote `{key}`"
                    );
                }
            }
            (Ok(()), Some(e)) => panic!("{index}: Python raised {e}, and assign_at wrote"),
            (Err(e), None) => panic!("{index}: Python wrote, and assign_at failed: {e}"),
            (Ok(()), None) => {
                let leaves = expected["leaves"].as_object().unwrap();
                assert_eq!(td.leaves().len(), leaves.len(), "{index}: leaves {:?}", td.keys(true, true));
                for (name, want) in leaves {
                    let t = td.get_tensor(name.split('.').collect::<Vec<&str>>().as_slice())?;
                    assert_eq!(t.dtype().as_str(), want["dtype"], "{index}: `{name}`");
                    assert_eq!(serde_json::to_value(t.dims())?, want["shape"], "{index}: `{name}`");
                    let want: Vec<f64> =
                        want["values"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
                    assert_eq!(t.to_dtype(DType::F64)?.to_vec::<f64>()?, want, "{index}: `{name}`");
                }
            }
        }
        checked += 1;
    }
    assert!(checked >= 45, "the table has the assignments by index ({checked})");
    Ok(())
}
