//! Non-tensor stacks (Python's `NonTensorStack`): one JSON value per batch element, nested one
//! list level per batch dim, indexed, split, stacked and concatenated with the elements, stored
//! as Python stores them.

use std::fs;

use memmap_tensor::{Access, DType, Location, Tensor};
use serde_json::{Value, json};
use tensordict::{Entry, Error, Index, ReadMode, TensorDict};
use tensordict_aio::Engine;

mod common;
use common::TestResult;

fn names(n: usize) -> Vec<Value> {
    (0..n).map(|i| json!(format!("ep{i}"))).collect()
}

fn sample(n: usize) -> Result<TensorDict, Box<dyn std::error::Error>> {
    let mut td = TensorDict::new([n]);
    td.set("x", Tensor::zeros([n, 2], DType::F32, &Location::Heap)?)?;
    td.set("names", Entry::stack(names(n)))?;
    Ok(td)
}

#[test]
fn a_stack_must_have_one_value_per_row() -> TestResult {
    let mut td = sample(3)?;
    assert!(matches!(td.set("bad", Entry::stack(names(2))), Err(Error::BatchSizeMismatch { .. })));
    assert!(matches!(td.set("bad", Entry::NonTensorStack(json!("not a list"))), Err(Error::BatchSizeMismatch { .. })));
    let mut scalar = TensorDict::new(Vec::<usize>::new());
    assert!(scalar.set("s", Entry::stack(vec![])).is_err(), "a dict without batch dims has no rows to stack along");
    // Over two batch dims, one list per row, each as long as the second dim.
    let mut two = TensorDict::new([2, 2]);
    two.set("ok", Entry::NonTensorStack(json!([[1, 2], [3, 4]])))?;
    assert!(matches!(
        two.set("bad", Entry::NonTensorStack(json!([[1, 2], [3]]))),
        Err(Error::BatchSizeMismatch { .. })
    ));
    assert!(matches!(two.set("bad", Entry::stack(names(2))), Err(Error::BatchSizeMismatch { .. })));
    assert_eq!(td.get_non_tensor("names")?, &json!(["ep0", "ep1", "ep2"]));
    Ok(())
}

#[test]
fn indexing_the_first_dim_indexes_the_values() -> TestResult {
    let td = sample(5)?;
    assert_eq!(td.index(1i64)?.get("names")?.as_non_tensor(), Some(&json!("ep1")));
    assert!(matches!(td.index(-1i64)?.get("names")?, Entry::NonTensor(v) if v == "ep4"));
    assert_eq!(td.index(Index::slice(Some(1), None, 2))?.get_non_tensor("names")?, &json!(["ep1", "ep3"]));
    assert_eq!(td.index(vec![4i64, 0, 0])?.get_non_tensor("names")?, &json!(["ep4", "ep0", "ep0"]));
    assert_eq!(td.index(vec![true, false, false, false, true])?.get_non_tensor("names")?, &json!(["ep0", "ep4"]));
    // A new dim nests the values one level deeper.
    assert_eq!(
        td.index((Index::NewDim, Index::slice(None, Some(2), 1)))?.get_non_tensor("names")?,
        &json!([["ep0", "ep1"]])
    );
    // Over two dims, every dim can be indexed, the values move with the elements.
    let mut grid = TensorDict::new([2, 3]);
    grid.set("v", Entry::NonTensorStack(json!([[0, 1, 2], [10, 11, 12]])))?;
    assert_eq!(grid.index((Index::full(), 2i64))?.get_non_tensor("v")?, &json!([2, 12]));
    assert_eq!(grid.index((vec![1i64, 0], vec![0i64, 2]))?.get_non_tensor("v")?, &json!([10, 2]));
    assert_eq!(grid.index((Index::full(), vec![2i64, 0]))?.get_non_tensor("v")?, &json!([[2, 0], [12, 10]]));
    Ok(())
}

#[test]
fn batch_operations_move_the_values_with_the_rows() -> TestResult {
    let td = sample(4)?;
    let parts = td.split(&[1, 3], 0)?;
    assert_eq!(parts[1].get_non_tensor("names")?, &json!(["ep1", "ep2", "ep3"]));
    assert_eq!(td.chunk(2, 0)?[1].get_non_tensor("names")?, &json!(["ep2", "ep3"]));
    assert!(matches!(td.unbind(0)?[3].get("names")?, Entry::NonTensor(v) if v == "ep3"));
    let joined = TensorDict::cat(&[&parts[1], &parts[0]], 0)?;
    assert_eq!(joined.get_non_tensor("names")?, &json!(["ep1", "ep2", "ep3", "ep0"]));
    // Stacking along a new dim pairs the values up, as Python's torch.stack does.
    let reversed = td.index(vec![3i64, 2, 1, 0])?;
    assert_eq!(
        TensorDict::stack(&[&td, &reversed], 1)?.get_non_tensor("names")?,
        &json!([["ep0", "ep3"], ["ep1", "ep2"], ["ep2", "ep1"], ["ep3", "ep0"]])
    );
    let mut backwards = names(4);
    backwards.reverse();
    assert_eq!(TensorDict::stack(&[&td, &reversed], 0)?.get_non_tensor("names")?, &json!([names(4), backwards]));
    assert_eq!(td.unsqueeze(0)?.get_non_tensor("names")?, &json!([names(4)]));
    assert_eq!(td.unsqueeze(1)?.get_non_tensor("names")?, &json!([["ep0"], ["ep1"], ["ep2"], ["ep3"]]));
    assert!(
        matches!(td.index(Index::slice(Some(0), Some(1), 1))?.squeeze(0)?.get("names")?, Entry::NonTensor(v) if v == "ep0")
    );
    assert_eq!(td.reshape(&[2, 2])?.get_non_tensor("names")?, &json!([["ep0", "ep1"], ["ep2", "ep3"]]));
    assert!(td.reshape(&[8]).is_err());
    Ok(())
}

#[test]
fn stacks_are_stored_as_python_stores_them_and_travel_everywhere() -> TestResult {
    let dir = tempfile::tempdir()?;
    let td = sample(6)?;
    let path = dir.path().join("td");
    let on_disk = td.memmap(&path)?;
    let meta = fs::read_to_string(path.join("names/meta.json"))?;
    assert_eq!(
        meta,
        r#"{"_type":"<class 'tensordict.tensorclass.NonTensorStack'>","_format_version":1,"_class":"tensordict:NonTensorStack","stack_dim":0,"device":null,"data":["ep0","ep1","ep2","ep3","ep4","ep5"]}"#
    );
    let parent: Value = serde_json::from_str(&fs::read_to_string(path.join("meta.json"))?)?;
    assert_eq!(parent["names"], json!({"type": "NonTensorStack"}));
    assert_eq!(TensorDict::load_memmap(&path, Access::ReadOnly)?.get_non_tensor("names")?, td.get_non_tensor("names")?);
    let engine = Engine::new()?;
    let rows = on_disk.gather_direct(&engine, &[5, 0], ReadMode::Buffered)?;
    assert_eq!(rows.get_non_tensor("names")?, &json!(["ep5", "ep0"]));
    let offloader = tensordict_aio::Offloader::with_engine(dir.path().join("off"), engine)?;
    td.offload(&offloader, "t")?;
    assert_eq!(TensorDict::restore(&offloader, "t")?.get_non_tensor("names")?, td.get_non_tensor("names")?);
    Ok(())
}

#[test]
fn bad_stack_folders_are_refused() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("td");
    sample(3)?.memmap(&path)?;
    let stack_meta = path.join("names/meta.json");
    // A pickled stack loads as an entry not read; one without data is a damaged folder.
    fs::write(&stack_meta, r#"{"_type":"x","stack_dim":0,"data":"pickle.pkl"}"#)?;
    match TensorDict::load_memmap(&path, Access::ReadOnly)?.get_non_tensor("names") {
        Err(Error::Unreadable { what, .. }) => assert!(what.contains("pickled"), "{what}"),
        other => panic!("{other:?}"),
    }
    fs::write(&stack_meta, r#"{"_type":"x","stack_dim":0}"#)?;
    match TensorDict::load_memmap(&path, Access::ReadOnly) {
        Err(e @ Error::InvalidMeta { .. }) => assert!(e.to_string().contains("`data` is neither"), "{e}"),
        other => panic!("{other:?}"),
    }
    // Any stack_dim is read (the data is in batch order); one that is not a dim is refused.
    fs::write(&stack_meta, r#"{"stack_dim":1,"data":[1,2,3]}"#)?;
    assert_eq!(TensorDict::load_memmap(&path, Access::ReadOnly)?.get_non_tensor("names")?, &json!([1, 2, 3]));
    fs::write(&stack_meta, r#"{"stack_dim":"x","data":[1,2,3]}"#)?;
    assert!(matches!(TensorDict::load_memmap(&path, Access::ReadOnly), Err(Error::InvalidMeta { .. })));
    fs::write(&stack_meta, r#"{"stack_dim":0,"data":[1,2]}"#)?;
    assert!(matches!(TensorDict::load_memmap(&path, Access::ReadOnly), Err(Error::BatchSizeMismatch { .. })));
    Ok(())
}
