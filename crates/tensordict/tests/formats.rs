//! Lazy stacks and tensorclasses written by Python tensordict 0.15.3
//! (`tools/python/make_format_fixtures.py`): read here leaf by leaf against
//! `formats.expected.json`, written back byte for byte as Python wrote them, indexed, and
//! hostile variants refused with one error and nothing written.

use std::fs;
use std::path::{Path, PathBuf};

use memmap_tensor::{Access, DType, Location, Tensor};
use serde_json::Value;
use tensordict::{Entry, Error, Index, LazyStack, TensorClass, TensorDict};

mod common;
use common::{TestResult, copy_dir, files_below};

fn formats() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tensordict-0.15/formats")
}

fn expected(name: &str) -> Value {
    let all: Value = serde_json::from_slice(&fs::read(formats().join("formats.expected.json")).unwrap()).unwrap();
    all[name].clone()
}

/// The values of a tensor as Python's `tolist()` of its float64 (or bool) copy.
fn values(t: &Tensor) -> Result<Vec<Value>, Box<dyn std::error::Error>> {
    let t = t.contiguous()?;
    Ok(match t.dtype() {
        DType::Bool => t.to_vec_bool()?.into_iter().map(Value::from).collect(),
        _ => t.to_dtype(DType::F64)?.to_vec::<f64>()?.into_iter().map(Value::from).collect(),
    })
}

/// Every tensor of `td` (elements of lazy stacks as `key[i]`, tensorclasses as their fields)
/// as `formats.expected.json` lists them.
fn leaves_of(entry: &Entry, prefix: &str, out: &mut serde_json::Map<String, Value>) -> TestResult {
    match entry {
        Entry::Tensor(t) => {
            out.insert(
                prefix.to_owned(),
                serde_json::json!({"dtype": t.dtype().as_torch_str(), "shape": t.dims(), "values": values(t)?}),
            );
        }
        Entry::Dict(d) => {
            for (name, child) in d.iter() {
                let key = if prefix.is_empty() { name.to_owned() } else { format!("{prefix}.{name}") };
                leaves_of(child, &key, out)?;
            }
        }
        Entry::Lazy(l) => {
            for (i, item) in l.items().iter().enumerate() {
                leaves_of(&Entry::Dict(item.clone()), &format!("{prefix}[{i}]"), out)?;
            }
        }
        _ => {}
    }
    Ok(())
}

fn check_against(name: &str, entry: &Entry, batch: &[usize]) -> TestResult {
    let want = expected(name);
    assert_eq!(want["batch_size"], serde_json::json!(batch), "{name}: batch size");
    let mut got = serde_json::Map::new();
    leaves_of(entry, "", &mut got)?;
    assert_eq!(Value::Object(got), want["leaves"], "{name}: leaves");
    Ok(())
}

/// Every file below `a` holds the same bytes below `b`, and no other file is there.
fn same_files(a: &Path, b: &Path) {
    assert_eq!(files_below(a), files_below(b), "the same files");
    for file in files_below(a) {
        assert_eq!(fs::read(a.join(&file)).unwrap(), fs::read(b.join(&file)).unwrap(), "{} differs", file.display());
    }
}

#[test]
fn a_lazy_stack_of_different_shapes_loads_as_python_wrote_it_and_writes_back_byte_for_byte() -> TestResult {
    let stack = LazyStack::load_memmap(formats().join("lazy_root"), Access::ReadOnly)?;
    assert_eq!(stack.batch_size(), [3, 2]);
    assert_eq!((stack.dim(), stack.len(), stack.dim_name()), (0, 3, None));
    check_against("lazy_root", &Entry::Lazy(stack.clone()), &stack.batch_size())?;
    let widths: Vec<usize> =
        stack.items().iter().map(|td| td.get_tensor("obs").map(|t| t.dims()[1])).collect::<Result<_, _>>()?;
    assert_eq!(widths, [3, 4, 5]);

    let dir = tempfile::tempdir()?;
    let written = stack.memmap(dir.path().join("copy"))?;
    same_files(&formats().join("lazy_root"), &dir.path().join("copy"));
    check_against("lazy_root", &Entry::Lazy(written), &stack.batch_size())?;
    Ok(())
}

#[test]
fn a_stack_folder_opened_as_a_dict_and_a_dict_folder_opened_as_a_stack_say_which_to_use() -> TestResult {
    let err = TensorDict::load_memmap(formats().join("lazy_root"), Access::ReadOnly).unwrap_err();
    assert!(matches!(err, Error::OtherKind { open_with: "LazyStack::load_memmap", .. }), "{err}");
    assert!(err.to_string().contains("lazy stack"), "{err}");
    let err = LazyStack::load_memmap(formats().join("class_nested"), Access::ReadOnly).unwrap_err();
    assert!(matches!(err, Error::OtherKind { open_with: "TensorDict::load_memmap", .. }), "{err}");
    Ok(())
}

#[test]
fn a_lazy_stack_along_dim_1_densifies_and_stacks_a_key() -> TestResult {
    let stack = LazyStack::load_memmap(formats().join("lazy_dim1"), Access::ReadOnly)?;
    assert_eq!((stack.batch_size(), stack.dim()), (vec![4, 2], 1));
    check_against("lazy_dim1", &Entry::Lazy(stack.clone()), &[4, 2])?;
    let dense = stack.densify()?;
    assert_eq!(dense.batch_size(), [4, 2]);
    // a[i, k] = i + 10 k
    assert_eq!(dense.get_tensor("a")?.contiguous()?.to_vec::<i64>()?, [0, 10, 1, 11, 2, 12, 3, 13]);
    assert_eq!(stack.get_tensor("a")?.to_vec::<i64>()?, dense.get_tensor("a")?.contiguous()?.to_vec::<i64>()?);
    Ok(())
}

#[test]
fn shapes_that_differ_do_not_densify_and_the_error_names_the_key_and_shapes() -> TestResult {
    let stack = LazyStack::load_memmap(formats().join("lazy_root"), Access::ReadOnly)?;
    let err = stack.get_tensor("obs").unwrap_err().to_string();
    assert!(err.contains("`obs`") && err.contains("[2, 3]") && err.contains("[2, 4]"), "{err}");
    assert!(stack.densify().is_err());
    // Keys that agree stack.
    assert_eq!(stack.get_tensor("reward")?.dims(), [3, 2, 1]);
    assert_eq!(stack.get_tensor(["next", "done"])?.to_vec_bool()?, [true, true, false, true, true, true]);
    Ok(())
}

#[test]
fn indexing_a_lazy_stack_picks_elements_at_the_stack_dim_and_indexes_each_by_the_rest() -> TestResult {
    let stack = LazyStack::load_memmap(formats().join("lazy_root"), Access::ReadOnly)?;
    // An integer at the stack dim: that element, a plain dict, a view of its file.
    let Entry::Dict(second) = stack.index(1)? else { panic!("an element is a dict") };
    assert_eq!(second.get_tensor("obs")?.dims(), [2, 4]);
    assert!(second.is_memmap());
    // A negative integer, then the rest of the index applied to the element.
    let Entry::Dict(row) = stack.index((-1, 1))? else { panic!("a dict") };
    assert_eq!(row.batch_size(), [] as [usize; 0]);
    assert_eq!(row.get_tensor("obs")?.to_vec::<f32>()?, [205.0, 206.0, 207.0, 208.0, 209.0]);
    // A slice and a list at the stack dim: a stack of the elements picked.
    let Entry::Lazy(tail) = stack.index(Index::slice(Some(1), None, 1))? else { panic!("a stack") };
    assert_eq!((tail.batch_size(), tail.items()[0].get_tensor("obs")?.dims()[1]), (vec![2, 2], 4));
    let Entry::Lazy(picked) = stack.index((vec![2, 0, 2], 0))? else { panic!("a stack") };
    assert_eq!(picked.batch_size(), [3]);
    let widths: Vec<usize> = picked.items().iter().map(|td| td.get_tensor("obs").unwrap().dims()[0]).collect();
    assert_eq!(widths, [5, 3, 5]);
    // `...` and a mask.
    let Entry::Lazy(masked) = stack.index((Index::Mask(vec![true, false, true]), Index::Ellipsis))? else {
        panic!("a stack")
    };
    assert_eq!(masked.len(), 2);
    // Out of range, a mask of the wrong length, too many indices: errors naming the index.
    for bad in [Index::Int(3), Index::Mask(vec![true]), Index::Tuple(vec![Index::Int(0), Index::Int(0), Index::Int(0)])]
    {
        assert!(matches!(stack.index(bad.clone()), Err(Error::InvalidIndex { .. })), "{bad}");
    }
    // Two lists would pair rows across elements of different shapes: refused, saying why.
    let err = stack.index((vec![0, 1], vec![0, 1])).unwrap_err().to_string();
    assert!(err.contains("do not stack"), "{err}");
    Ok(())
}

#[test]
fn a_nested_lazy_stack_loads_as_an_entry_and_follows_its_dict_through_index_and_write() -> TestResult {
    let td = TensorDict::load_memmap(formats().join("lazy_nested"), Access::ReadOnly)?;
    assert!(td.unreadable().is_empty(), "nothing of it is left unread");
    check_against("lazy_nested", &Entry::Dict(td.clone()), td.batch_size())?;
    let Entry::Lazy(agents) = td.get("agents")? else { panic!("agents is a lazy stack") };
    assert_eq!((agents.batch_size(), agents.dim()), (vec![2, 3], 1));

    // td[1]: the dense key and every agent indexed at row 1, still stacked.
    let row = td.index(1)?;
    let Entry::Lazy(one) = row.get("agents")? else { panic!("still a lazy stack") };
    assert_eq!((one.batch_size(), one.dim()), (vec![3], 0));
    assert_eq!(one.items()[1].get_tensor("obs")?.to_vec::<f32>()?, [2.0, 3.0, 4.0]);
    assert_eq!(row.get_tensor("done")?.to_vec_bool()?, [true]);
    // td[[1, 0]]: the rows gathered in every agent.
    let swapped = td.index(vec![1, 0])?;
    let Entry::Lazy(agents2) = swapped.get("agents")? else { panic!("still a lazy stack") };
    assert_eq!(agents2.items()[0].get_tensor("obs")?.to_vec::<f32>()?, [2.0, 3.0, 0.0, 1.0]);

    let dir = tempfile::tempdir()?;
    td.memmap(dir.path().join("copy"))?;
    same_files(&formats().join("lazy_nested"), &dir.path().join("copy"));
    Ok(())
}

#[test]
fn a_tensorclass_loads_as_a_dict_that_remembers_its_class_and_writes_back_byte_for_byte() -> TestResult {
    let point = TensorDict::load_memmap(formats().join("class_root"), Access::ReadOnly)?;
    let class = point.class().expect("a tensorclass");
    assert_eq!((class.path(), class.name(), class.module()), ("fixture_classes.Point", "Point", "fixture_classes"));
    assert_eq!(point.get_non_tensor("label")?, "origin");
    check_against("class_root", &Entry::Dict(point.clone()), point.batch_size())?;
    // Indexing and clones keep the class.
    assert_eq!(point.index(vec![2, 0])?.class(), Some(class));
    assert_eq!(point.index(1)?.class(), Some(class));
    assert_eq!(point.deep_clone()?.class(), Some(class));

    let dir = tempfile::tempdir()?;
    let written = point.memmap(dir.path().join("copy"))?;
    assert_eq!(written.class(), Some(class));
    same_files(&formats().join("class_root"), &dir.path().join("copy"));
    Ok(())
}

#[test]
fn nested_tensorclasses_and_their_pickled_fields_load_and_copy_whole() -> TestResult {
    let td = TensorDict::load_memmap(formats().join("class_nested"), Access::ReadOnly)?;
    check_against("class_nested", &Entry::Dict(td.clone()), td.batch_size())?;
    assert_eq!(td.get_dict("point")?.class().map(TensorClass::path), Some("fixture_classes.Point"));
    let step = td.get_dict("step")?;
    assert_eq!(step.class().map(TensorClass::path), Some("fixture_classes.Step"));
    assert_eq!(step.get_dict("point")?.class().map(TensorClass::name), Some("Point"));
    // Only the pickled value is not read.
    let unread: Vec<String> = td.unreadable().into_iter().map(|(k, _)| k.joined(".")).collect();
    assert_eq!(unread, ["step.tags"]);

    let dir = tempfile::tempdir()?;
    td.memmap(dir.path().join("copy"))?;
    same_files(&formats().join("class_nested"), &dir.path().join("copy"));
    Ok(())
}

#[test]
fn a_dict_given_a_class_is_written_as_that_tensorclass() -> TestResult {
    let mut td = TensorDict::new([2]);
    td.set("x", Tensor::from_slice(&[1.0f32, 2.0], [2])?)?;
    td.set_class(Some(TensorClass::new("fixture_classes.Point")?));
    let dir = tempfile::tempdir()?;
    td.memmap(dir.path().join("p"))?;
    let meta: Value = serde_json::from_slice(&fs::read(dir.path().join("p/meta.json"))?)?;
    assert_eq!(meta, serde_json::json!({"_type": "<class 'fixture_classes.Point'>"}));
    assert!(dir.path().join("p/_tensordict/x.memmap").is_file());
    for bad in ["Point", "a..b", "1mod.Name", "mod.Na me", "mod.'>"] {
        assert!(TensorClass::new(bad).is_err(), "{bad}");
    }
    Ok(())
}

/// A copy of the fixture `name` with `edit` applied, in a temporary folder.
fn edited(name: &str, edit: impl FnOnce(&Path)) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let copy = dir.path().join(name);
    copy_dir(&formats().join(name), &copy);
    edit(&copy);
    (dir, copy)
}

fn set_meta(file: &Path, key: &str, value: Value) {
    let mut meta: Value = serde_json::from_slice(&fs::read(file).unwrap()).unwrap();
    meta[key] = value;
    fs::write(file, serde_json::to_vec(&meta).unwrap()).unwrap();
}

/// A change made to a copy of a fixture.
type Edit = Box<dyn FnOnce(&Path)>;

#[test]
fn hostile_lazy_stacks_and_tensorclasses_are_refused_with_one_error() {
    let cases: Vec<(&str, &str, Edit)> = vec![
        ("lazy_dim1", "do not stack", Box::new(|p| set_meta(&p.join("1/meta.json"), "shape", serde_json::json!([])))),
        ("lazy_root", "stack dim 5", Box::new(|p| set_meta(&p.join("meta.json"), "stack_dim", serde_json::json!(5)))),
        ("lazy_root", "stack_dim", Box::new(|p| set_meta(&p.join("meta.json"), "stack_dim", serde_json::json!("0")))),
        (
            "lazy_root",
            "stack_dim_name",
            Box::new(|p| set_meta(&p.join("meta.json"), "stack_dim_name", serde_json::json!(7))),
        ),
        ("lazy_root", "without elements", Box::new(|p| fs::rename(p.join("0"), p.join("zero")).unwrap())),
        ("lazy_root", "meta.json", Box::new(|p| fs::remove_file(p.join("2/meta.json")).unwrap())),
        ("lazy_root", "obs", Box::new(|p| fs::write(p.join("2/obs.memmap"), b"short").unwrap())),
    ];
    for (name, says, edit) in cases {
        let (_dir, copy) = edited(name, edit);
        let err = LazyStack::load_memmap(&copy, Access::ReadOnly).unwrap_err().to_string();
        assert!(err.contains(says), "{name}: `{err}` should say `{says}`");
    }
    // A lazy stack inside a dict whose batch does not start with the dict's.
    let (_dir, copy) =
        edited("lazy_nested", |p| set_meta(&p.join("agents/meta.json"), "stack_dim", serde_json::json!(0)));
    let err = TensorDict::load_memmap(&copy, Access::ReadOnly).unwrap_err();
    assert!(matches!(err, Error::BatchSizeMismatch { .. }), "{err}");
    // A tensorclass folder without its fields.
    let (_dir, copy) = edited("class_root", |p| fs::remove_dir_all(p.join("_tensordict")).unwrap());
    let err = TensorDict::load_memmap(&copy, Access::ReadOnly).unwrap_err().to_string();
    assert!(err.contains("_tensordict") && err.contains("fixture_classes.Point"), "{err}");
    // Inside a dict, a class folder without its fields is kept as an entry not read.
    let (_dir, copy) = edited("class_nested", |p| fs::remove_dir_all(p.join("point/_tensordict")).unwrap());
    let td = TensorDict::load_memmap(&copy, Access::ReadOnly).unwrap();
    assert!(matches!(td.get("point"), Ok(Entry::Unreadable(_))));
    // A `_type` that names no class path is not read.
    let (_dir, copy) =
        edited("class_root", |p| set_meta(&p.join("meta.json"), "_type", serde_json::json!("<class 'x'>")));
    assert!(matches!(TensorDict::load_memmap(&copy, Access::ReadOnly), Err(Error::Unsupported { .. })));
}

#[test]
fn a_failed_write_of_a_stack_leaves_nothing_behind() -> TestResult {
    let mut a = TensorDict::new([2]);
    a.set("x", Tensor::zeros([2], DType::F32, &Location::Heap)?)?;
    let mut b = TensorDict::new([2]);
    b.set("x", Tensor::zeros([2, 3], DType::F32, &Location::Heap)?)?;
    let stack = LazyStack::new(vec![a.clone(), b], 0)?;
    let dir = tempfile::tempdir()?;
    let written = stack.memmap(dir.path().join("s"))?;
    assert_eq!(written.batch_size(), [2, 2]);
    // Replacing needs asking, and a refused write leaves the old folder as it was.
    let before = files_below(&dir.path().join("s")).len();
    assert!(matches!(LazyStack::new(vec![a], 0)?.memmap(dir.path().join("s")), Err(Error::WouldReplace { .. })));
    assert_eq!(files_below(&dir.path().join("s")).len(), before);
    assert_eq!(fs::read_dir(dir.path())?.count(), 1, "no staging folder left");
    // Stacking dicts of different batch sizes is refused.
    let mut c = TensorDict::new([3]);
    c.set("x", Tensor::zeros([3], DType::F32, &Location::Heap)?)?;
    assert!(LazyStack::new(vec![TensorDict::new([2]), c], 0).is_err());
    assert!(LazyStack::new(Vec::new(), 0).is_err());
    Ok(())
}

/// A chain of `levels` dicts, each holding the next under `n` as `wrap` makes it, the last
/// holding one tensor.
fn chain(levels: usize, wrap: &dyn Fn(TensorDict) -> tensordict::Result<Entry>) -> tensordict::Result<TensorDict> {
    let mut td = TensorDict::new([1]);
    let x =
        Tensor::zeros([1], DType::F32, &Location::Heap).map_err(|source| Error::Tensor { key: "x".into(), source })?;
    td.set("x", x)?;
    for _ in 0..levels {
        let mut parent = TensorDict::new([1]);
        parent.set("n", wrap(td)?)?;
        td = parent;
    }
    Ok(td)
}

#[test]
fn the_deepest_tensorclasses_and_lazy_stacks_allowed_write_and_load() -> TestResult {
    // On the test's own thread, as `limits.rs` runs the deepest plain dicts.
    let class = |mut td: TensorDict| {
        td.set_class(Some(TensorClass::new("m.C")?));
        Ok(Entry::Dict(td))
    };
    let lazy = |td: TensorDict| Ok(Entry::Lazy(LazyStack::new(vec![td], 1)?));
    let classes = chain(tensordict::MAX_DEPTH - 1, &class)?;
    let stacks = chain(tensordict::MAX_DEPTH / 2 - 1, &lazy)?;
    // One level more is refused when made.
    let mut top = chain(1, &|td| Ok(Entry::Dict(td)))?;
    assert!(matches!(top.insert(["n", "n"], classes.clone()), Err(Error::TooDeep { .. })));
    let dir = tempfile::tempdir()?;
    for (name, td) in [("classes", classes), ("stacks", stacks)] {
        td.memmap(dir.path().join(name))?;
        let loaded = TensorDict::load_memmap(dir.path().join(name), Access::ReadOnly)?;
        assert_eq!(loaded.depth(), td.depth(), "{name}");
        TensorDict::read_memmap(dir.path().join(name))?;
        assert!(TensorDict::verify_memmap(dir.path().join(name)).is_empty());
    }
    Ok(())
}

/// A writable copy of the fixture `name`, loaded.
fn writable(name: &str) -> Result<(tempfile::TempDir, TensorDict), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    copy_dir(&formats().join(name), &dir.path().join(name));
    let td = TensorDict::load_memmap(dir.path().join(name), Access::ReadWrite)?;
    Ok((dir, td))
}

fn agent_obs(td: &TensorDict, agent: usize) -> Result<Vec<f32>, Box<dyn std::error::Error>> {
    let Entry::Lazy(agents) = td.get("agents")? else { panic!("agents is a lazy stack") };
    Ok(agents.items()[agent].get_tensor("obs")?.contiguous()?.to_vec::<f32>()?)
}

#[test]
fn rows_of_a_dict_holding_a_lazy_stack_are_written_in_every_one_of_its_dicts() -> TestResult {
    let (_dir, mut td) = writable("lazy_nested")?;
    // td[[1, 0]] = td[[0, 1]]: the rows swap in the dense key and in every agent, on disk.
    let swapped = td.index(vec![0, 1])?;
    td.set_at(vec![1, 0], &swapped)?;
    // (agent 1 holds [[-1, 0, 1], [2, 3, 4]] in the fixture)
    assert_eq!(agent_obs(&td, 1)?, [2.0, 3.0, 4.0, -1.0, 0.0, 1.0]);
    assert_eq!(td.get_tensor("done")?.to_vec_bool()?, [true, false]);
    // An integer row: one row of every agent.
    let row = td.index(0)?;
    td.set_at(1, &row)?;
    assert_eq!(agent_obs(&td, 1)?, [2.0, 3.0, 4.0, 2.0, 3.0, 4.0]);
    // The same through the scatter (a replay buffer's write) and `assign_at`.
    let (_dir2, mut other) = writable("lazy_nested")?;
    other.scatter_index(&memmap_tensor::RowIndex::new(&[1, 0], 2)?, &td.index(vec![0, 1])?)?;
    assert_eq!(agent_obs(&other, 1)?, [2.0, 3.0, 4.0, 2.0, 3.0, 4.0]);
    other.assign_at(vec![0], &td.index(vec![1])?)?;
    // A stack of another number of dicts, or a dict where a stack goes, writes nothing.
    let before = agent_obs(&td, 0)?;
    let Entry::Lazy(agents) = td.get("agents")? else { panic!() };
    let mut short = td.index(vec![0])?;
    short.set(
        "agents",
        LazyStack::new(agents.items()[..2].iter().map(|a| a.index(vec![0])).collect::<Result<_, _>>()?, 1)?,
    )?;
    let err = td.set_at(vec![1], &short).unwrap_err().to_string();
    assert!(err.contains("2 dicts written into the 3"), "{err}");
    assert_eq!(agent_obs(&td, 0)?, before);
    assert!(matches!(td.fill_at(0, &Tensor::from_slice(&[0.0f32], [])?), Err(Error::InvalidArgument { .. })));
    Ok(())
}

#[test]
fn a_lazy_stack_takes_its_dicts_and_rows_by_index() -> TestResult {
    let dir = tempfile::tempdir()?;
    copy_dir(&formats().join("lazy_root"), &dir.path().join("s"));
    let mut stack = LazyStack::load_memmap(dir.path().join("s"), Access::ReadWrite)?;
    // stack[2] = stack[0] would change shapes: refused, nothing written.
    let first = stack.index(0)?;
    assert!(stack.set_at(2, &first).is_err());
    // stack[1, 0] = stack[1, 1]: one row of one dict.
    let row = stack.index((1, 1))?;
    stack.set_at((1, 0), &row)?;
    let obs = stack.items()[1].get_tensor("obs")?.to_vec::<f32>()?;
    assert_eq!(obs, [104.0, 105.0, 106.0, 107.0, 104.0, 105.0, 106.0, 107.0]);
    // stack[[0, 2], 1] = stack[[0, 2], 0]: a row of two dicts.
    let rows = stack.index((vec![0, 2], 0))?;
    stack.set_at((vec![0, 2], 1), &rows)?;
    assert_eq!(stack.items()[2].get_tensor("obs")?.to_vec::<f32>()?[5..], [200.0, 201.0, 202.0, 203.0, 204.0]);
    Ok(())
}

#[test]
fn a_buffer_shaped_like_a_dict_holding_a_lazy_stack_takes_and_gives_its_rows() -> TestResult {
    // What a replay storage does: zeros of the schema with another number of rows, rows
    // scattered in, rows gathered out.
    let td = TensorDict::load_memmap(formats().join("lazy_nested"), Access::ReadOnly)?;
    let dir = tempfile::tempdir()?;
    let mut storage = td.memmap_like(dir.path().join("storage"), Some(6))?;
    let Entry::Lazy(agents) = storage.get("agents")? else { panic!("a lazy stack") };
    assert_eq!(agents.batch_size(), [6, 3]);
    assert_eq!(agents.items()[1].get_tensor("obs")?.dims(), [6, 3]);
    storage.scatter_index(&memmap_tensor::RowIndex::new(&[4, 5], 6)?, &td)?;
    let back = storage.gather_index(&memmap_tensor::RowIndex::new(&[5, 4], 6)?)?;
    assert_eq!(agent_obs(&back, 1)?, [2.0, 3.0, 4.0, -1.0, 0.0, 1.0]);
    assert_eq!(back.get_tensor("done")?.to_vec_bool()?, [true, false]);
    // A stack along the rows cannot take another number of rows.
    let stack = LazyStack::load_memmap(formats().join("lazy_root"), Access::ReadOnly)?;
    let mut holder = TensorDict::new([3]);
    holder.set("s", stack)?;
    assert!(holder.memmap_like(dir.path().join("other"), Some(6)).is_err());
    // The loader does not read lazy stacks yet: refused, saying which key.
    let err = tensordict::loader::Loader::new(td, tensordict::loader::LoaderOptions::new(1)).err().unwrap();
    assert!(err.to_string().contains("`agents`"), "{err}");
    Ok(())
}

#[test]
fn dicts_holding_tensorclasses_and_lazy_stacks_know_their_folder() -> TestResult {
    for name in ["class_root", "class_nested", "lazy_nested"] {
        let td = TensorDict::load_memmap(formats().join(name), Access::ReadOnly)?;
        assert_eq!(td.location()?, tensordict::DictLocation::Folder(formats().join(name)), "{name}");
    }
    // A tensorclass's fields are under `_tensordict`, itself a dict's folder: a plain dict of
    // them lives there.
    let td = TensorDict::load_memmap(formats().join("class_root"), Access::ReadOnly)?;
    let mut fields = TensorDict::new([3]);
    fields.set("x", td.get_tensor("x")?.clone())?;
    let inner = formats().join("class_root/_tensordict");
    assert_eq!(fields.location()?, tensordict::DictLocation::Folder(inner));
    Ok(())
}

#[test]
fn a_lazy_stack_prints_its_dicts() -> TestResult {
    let stack = LazyStack::load_memmap(formats().join("lazy_dim1"), Access::ReadOnly)?;
    let text = stack.to_string();
    assert!(text.starts_with("LazyStack(batch_size=[4,2], stack_dim=1, tensordicts=["), "{text}");
    assert_eq!(text.matches("TensorDict(batch_size=[4]").count(), 2, "{text}");
    Ok(())
}

#[test]
fn a_lazy_stack_reads_into_memory_as_it_loads() -> TestResult {
    let read = LazyStack::read_memmap(formats().join("lazy_root"))?;
    assert!(read.items().iter().all(|td| !td.is_memmap()), "nothing mapped");
    check_against("lazy_root", &Entry::Lazy(read), &[3, 2])?;
    let (_dir, copy) = edited("lazy_root", |p| fs::write(p.join("1/obs.memmap"), b"short").unwrap());
    let err = LazyStack::read_memmap(&copy).unwrap_err().to_string();
    assert!(err.contains("obs"), "{err}");
    Ok(())
}

#[test]
fn lazy_stacks_and_tensorclasses_go_into_shared_memory_and_come_back_whole() -> TestResult {
    let prefix = format!("tdict-formats-{}", std::process::id());
    let _ = TensorDict::unlink_shared(&prefix);
    let mut td = TensorDict::load_memmap(formats().join("lazy_nested"), Access::ReadOnly)?;
    td.set(
        "point",
        TensorDict::load_memmap(formats().join("class_root"), Access::ReadOnly)?.index(Index::slice(
            None,
            Some(2),
            1,
        ))?,
    )?;
    let result = (|| -> TestResult {
        let shared = td.share_memory(&prefix)?;
        let opened = TensorDict::open_shared(&prefix, Access::ReadOnly)?;
        for back in [&shared, &opened] {
            let Entry::Lazy(agents) = back.get("agents")? else { panic!("`agents` is a lazy stack") };
            assert_eq!((agents.dim(), agents.len()), (1, 3));
            assert_eq!(back.get_dict("point")?.class().map(TensorClass::path), Some("fixture_classes.Point"));
            check_against("lazy_nested", &Entry::Dict(back.exclude(&[tensordict::KeyPath::from("point")])), &[2])?;
        }
        // The schema it is stored under says the same, and parses back.
        let schema = tensordict::Schema::of(&opened, &mut |_, _| Ok(String::new()))?;
        assert_eq!(tensordict::Schema::from_json(&schema.to_json())?, schema);
        assert_eq!(
            schema.tensors().iter().map(|(k, _)| k.to_string()).collect::<Vec<_>>(),
            opened.stored_leaves().iter().map(|(k, _)| k.to_string()).collect::<Vec<_>>()
        );
        Ok(())
    })();
    TensorDict::unlink_shared(&prefix)?;
    result
}
