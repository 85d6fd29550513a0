//! A folder written by Python with entries this crate does not read (a pickled value, a stack
//! of them, a nested tensor, a complex tensor, and a pickled value in a nested dict, beside a
//! tensorclass and a lazy stack, which it reads; `tools/python/make_unreadable_fixture.py`):
//! the rest loads, each such entry is named and typed, asking for one is an error that says
//! what it holds, and a copy of the whole folder keeps them byte for byte.

use std::fs;
use std::path::{Path, PathBuf};

use memmap_tensor::Access;
use serde_json::Value;
use tensordict::{Entry, Error, KeyPath, TensorDict, WriteOptions};

mod common;
use common::{TestResult, copy_dir, files_below};

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tensordict-0.15/unreadable")
}

/// `(key, what)` of every entry not read, what cut to its first words.
fn not_read(td: &TensorDict) -> Vec<(String, String)> {
    td.unreadable().into_iter().map(|(k, u)| (k.joined("."), u.what().to_owned())).collect()
}

const NOT_READ: [(&str, &str); 5] = [
    ("z", "a tensor of dtype `torch.complex64`"),
    ("obj", "a pickled Python value (`other.pickle`)"),
    ("tags", "a stack of pickled Python values (`pickle.pkl`)"),
    ("nt", "a nested tensor (one of tensors of different shapes)"),
    ("next.info", "a pickled Python value (`other.pickle`)"),
];

fn expected_not_read() -> Vec<(String, String)> {
    NOT_READ.iter().map(|(k, w)| ((*k).to_owned(), (*w).to_owned())).collect()
}

#[test]
fn the_rest_of_the_folder_loads_and_the_entries_not_read_are_named_and_typed() -> TestResult {
    for td in [TensorDict::load_memmap(fixture(), Access::ReadOnly)?, TensorDict::read_memmap(fixture())?] {
        assert_eq!(td.batch_size(), &[3]);
        assert_eq!(td.get_tensor("obs")?.to_vec::<f32>()?, [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
        assert_eq!(td.get_tensor(["next", "reward"])?.to_vec::<f32>()?, [1.0, 0.0, -1.0]);
        assert_eq!(not_read(&td), expected_not_read());
        // Keys list them where Python has them; leaves are the tensors read (the tensorclass's
        // `x` among them; a lazy stack's elements are not keys of the dict).
        assert_eq!(td.keys(false, false).len(), 8);
        assert_eq!(td.leaves().len(), 3);
        assert!(matches!(td.get("obj")?, Entry::Unreadable(_)));
        assert!(matches!(td.get("lazy")?, Entry::Lazy(_)));
        assert_eq!(td.get_dict("point")?.class().map(tensordict::TensorClass::path), Some("__main__.Point"));
        let (_, nested) = &td.unreadable()[3];
        assert_eq!(nested.path(), fixture().join("nt.memmap"));
    }
    assert!(TensorDict::verify_memmap(fixture()).is_empty(), "entries not read are not defects");
    Ok(())
}

#[test]
fn asking_for_an_entry_not_read_says_what_it_holds_and_how_to_leave_it_out() -> TestResult {
    let td = TensorDict::load_memmap(fixture(), Access::ReadOnly)?;
    let e = td.get_tensor("z").unwrap_err();
    let Error::Unreadable { key, path, what } = &e else { panic!("{e:?}") };
    assert_eq!(key, &KeyPath::from("z"));
    assert_eq!(path, &fixture().join("z.memmap"));
    assert_eq!(what, "a tensor of dtype `torch.complex64`");
    let text = e.to_string();
    assert!(
        text.contains("key `z` holds a tensor of dtype `torch.complex64`, which this crate does not read"),
        "{text}"
    );
    assert!(text.contains("`TensorDict::exclude`"), "{text}");
    for (key, _) in NOT_READ {
        let key = KeyPath::new(key.split('.'));
        assert!(matches!(td.get_non_tensor(&key), Err(Error::Unreadable { .. })), "{key}");
        assert!(matches!(td.get_dict(&key), Err(Error::Unreadable { .. })), "{key}");
    }
    Ok(())
}

#[test]
fn batch_operations_refuse_the_dict_until_the_entries_are_left_out() -> TestResult {
    let td = TensorDict::load_memmap(fixture(), Access::ReadOnly)?;
    assert!(matches!(td.index(vec![2i64, 0]), Err(Error::Unreadable { .. })));
    let cpu = memmap_tensor::Device::Cpu;
    assert!(matches!(td.gather_to(cpu, &[1]).map(drop), Err(Error::Unreadable { .. })));
    assert!(matches!(TensorDict::stack(&[&td, &td], 0), Err(Error::Unreadable { .. })));
    assert!(matches!(td.memmap_like(tempfile::tempdir()?.path().join("like"), None), Err(Error::Unreadable { .. })));

    let keys: Vec<KeyPath> = td.unreadable().into_iter().map(|(k, _)| k).collect();
    let rest = td.exclude(&keys);
    assert!(rest.unreadable().is_empty());
    let rows = rest.index(vec![2i64, 0])?;
    assert_eq!(rows.get_tensor("obs")?.to_vec::<f32>()?, [4.0, 5.0, 0.0, 1.0]);
    assert_eq!(rows.get_tensor(["next", "reward"])?.to_vec::<f32>()?, [-1.0, 1.0]);
    Ok(())
}

#[test]
fn shared_memory_cannot_hold_them_and_is_left_untouched() -> TestResult {
    let td = TensorDict::load_memmap(fixture(), Access::ReadOnly)?;
    let prefix = format!("td-unreadable-{}", std::process::id());
    let e = td.share_memory(&prefix).unwrap_err();
    assert!(matches!(e, Error::Unreadable { .. }), "{e:?}");
    assert!(TensorDict::list_shared()?.iter().all(|info| info.prefix != prefix), "nothing was made");
    Ok(())
}

#[test]
fn a_copy_of_the_whole_folder_keeps_every_entry_byte_for_byte() -> TestResult {
    let tmp = tempfile::tempdir()?;
    let td = TensorDict::load_memmap(fixture(), Access::ReadOnly)?;
    let copy = tmp.path().join("copy");
    let written = td.memmap(&copy)?;
    assert_eq!(not_read(&written), expected_not_read());
    let e = written.get_tensor("z").unwrap_err();
    assert!(e.to_string().contains(&copy.display().to_string()), "the copy's entries are its own files: {e}");
    assert_eq!(files_below(&copy), files_below(&fixture()));
    for rel in files_below(&fixture()) {
        let (ours, theirs) = (fs::read(copy.join(&rel))?, fs::read(fixture().join(&rel))?);
        if rel.file_name().is_some_and(|n| n == "meta.json") && rel.parent() == Some(Path::new("")) {
            // The top meta.json is written again: the same records, entries not read included.
            let (a, b): (Value, Value) = (serde_json::from_slice(&ours)?, serde_json::from_slice(&theirs)?);
            assert_eq!(a, b, "top meta.json");
        } else if rel == Path::new("next/meta.json") {
            let (a, b): (Value, Value) = (serde_json::from_slice(&ours)?, serde_json::from_slice(&theirs)?);
            assert_eq!(a, b, "next/meta.json");
        } else {
            assert!(ours == theirs, "{}: bytes differ", rel.display());
        }
    }
    // A copy over an existing dict replaces it whole, entries not read included.
    td.exclude(&["obj"]).memmap_with(&copy, &WriteOptions::default().overwrite(true))?;
    assert!(!copy.join("obj").exists());
    assert_eq!(not_read(&TensorDict::load_memmap(&copy, Access::ReadOnly)?).len(), 4);
    Ok(())
}

#[test]
fn a_link_or_fifo_inside_an_entry_not_read_is_refused_and_nothing_is_written() -> TestResult {
    let tmp = tempfile::tempdir()?;
    let src = tmp.path().join("src");
    copy_dir(&fixture(), &src);
    let secret = tmp.path().join("secret");
    fs::write(&secret, b"outside the folder")?;
    std::os::unix::fs::symlink(&secret, src.join("tags/extra"))?;
    let td = TensorDict::load_memmap(&src, Access::ReadOnly)?;
    let dst = tmp.path().join("dst");
    let e = td.memmap(&dst).unwrap_err();
    assert!(e.to_string().contains("tags/extra"), "{e}");
    assert!(!dst.exists(), "a refused write leaves nothing at the destination");
    assert!(TensorDict::leftovers(&dst)?.is_empty(), "nor beside it");

    fs::remove_file(src.join("tags/extra"))?;
    let status = std::process::Command::new("mkfifo").arg(src.join("obj/fifo")).status()?;
    assert!(status.success());
    let td = TensorDict::load_memmap(&src, Access::ReadOnly)?;
    let e = td.memmap(&dst).unwrap_err();
    assert!(e.to_string().contains("obj/fifo"), "{e}");
    assert!(!dst.exists());
    Ok(())
}

#[test]
fn a_folder_that_is_itself_of_a_kind_not_read_is_refused_with_what_it_is() {
    let e = TensorDict::load_memmap(fixture().join("obj"), Access::ReadOnly).unwrap_err();
    assert!(matches!(e, Error::Unsupported { .. }), "{e:?}");
    let text = e.to_string();
    assert!(text.ends_with("which this crate does not read") && text.contains("NonTensorData"), "{text}");
    // A lazy stack is read, by the type that holds one.
    let e = TensorDict::load_memmap(fixture().join("lazy"), Access::ReadOnly).unwrap_err();
    assert!(e.to_string().ends_with("open it with `LazyStack::load_memmap`"), "{e}");
}

#[test]
fn a_dtype_that_torch_does_not_have_is_still_a_corrupt_folder() -> TestResult {
    let tmp = tempfile::tempdir()?;
    let src = tmp.path().join("src");
    copy_dir(&fixture(), &src);
    let meta = fs::read_to_string(src.join("meta.json"))?;
    fs::write(src.join("meta.json"), meta.replace("torch.complex64", "torch.banana"))?;
    let e = TensorDict::load_memmap(&src, Access::ReadOnly).unwrap_err();
    assert!(matches!(e, Error::InvalidMeta { .. }), "{e:?}");
    assert!(e.to_string().contains("unknown dtype `torch.banana`"), "{e}");
    Ok(())
}
