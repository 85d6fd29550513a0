//! The archives `torch.save` writes for consolidated dicts (`tools/python/make_format_fixtures.py`,
//! tensordict 0.15.3): opened by `open_consolidated` as views of the archive itself, with the
//! leaves of the consolidated file of the same dict; a dict saved without consolidating, and
//! hostile archives (another call pickled, a storage of another type, missing or short, a
//! truncated pickle or archive), refused with one error.

use std::fs;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap_tensor::Access;
use tensordict::{DictLocation, Entry, TensorDict};

mod common;
use common::TestResult;

fn formats() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tensordict-0.15/formats")
}

/// Every stored leaf of `a` holds the bytes of `b`'s under the same key (a consolidated file
/// lists a dict's leaves before its nested dicts, a folder in insertion order).
fn same_leaves(a: &TensorDict, b: &TensorDict) -> TestResult {
    let sorted = |td: &TensorDict| {
        let mut leaves: Vec<_> = td.stored_leaves().into_iter().map(|(k, t)| (k.to_string(), t.clone())).collect();
        leaves.sort_by(|x, y| x.0.cmp(&y.0));
        leaves
    };
    let (a, b) = (sorted(a), sorted(b));
    assert_eq!(a.iter().map(|(k, _)| k).collect::<Vec<_>>(), b.iter().map(|(k, _)| k).collect::<Vec<_>>());
    for ((key, x), (_, y)) in a.iter().zip(&b) {
        assert_eq!((x.dtype(), x.dims()), (y.dtype(), y.dims()), "`{key}`");
        assert_eq!(x.to_bytes()?, y.to_bytes()?, "`{key}`");
    }
    Ok(())
}

#[test]
fn an_archive_of_a_consolidated_dict_opens_as_views_of_the_archive() -> TestResult {
    let path = formats().join("saved.pt");
    let saved = TensorDict::open_consolidated(&path, Access::ReadOnly)?;
    let consolidated = TensorDict::open_consolidated(formats().join("consolidated.td"), Access::ReadOnly)?;
    assert_eq!(saved.batch_size(), [4]);
    assert_eq!(saved.get_non_tensor("name")?, "run-1");
    same_leaves(&saved, &consolidated)?;
    // One mapping of the archive holds every leaf, past the entries before the storage's.
    let leaves = saved.leaves();
    assert!(leaves.iter().all(|(_, t)| Arc::ptr_eq(t.storage(), leaves[0].1.storage())));
    assert!(leaves.iter().all(|(_, t)| t.byte_offset() >= 64), "views into the archive's storage entry");
    assert_eq!(leaves[0].1.storage().path(), Some(path.as_path()));
    // Written out consolidated, it is the file Python wrote for the same dict.
    let dir = tempfile::tempdir()?;
    saved.deep_clone()?.consolidate(dir.path().join("again.td"))?;
    assert_eq!(fs::read(dir.path().join("again.td"))?, fs::read(formats().join("consolidated.td"))?);
    Ok(())
}

#[test]
fn an_archive_of_a_dict_holding_a_lazy_stack_opens_with_its_stack() -> TestResult {
    let saved = TensorDict::open_consolidated(formats().join("saved_lazy.pt"), Access::ReadOnly)?;
    let folder = TensorDict::load_memmap(formats().join("lazy_nested"), Access::ReadOnly)?;
    assert_eq!(saved.batch_size(), folder.batch_size());
    let Entry::Lazy(agents) = saved.get("agents")? else { panic!("`agents` is a lazy stack") };
    assert_eq!((agents.dim(), agents.len()), (1, 3));
    same_leaves(&saved, &folder)?;
    Ok(())
}

#[test]
fn writes_through_an_archive_opened_read_write_land_in_it_and_a_reference_carries_it() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("saved.pt");
    fs::copy(formats().join("saved.pt"), &path)?;
    let mut saved = TensorDict::open_consolidated(&path, Access::ReadWrite)?;
    saved.get_tensor_mut("action")?.as_mut_slice::<i64>()?[2] = 42;
    saved.flush()?;
    drop(saved);
    let again = TensorDict::open_consolidated(&path, Access::ReadOnly)?;
    assert_eq!(again.get_tensor("action")?.to_vec::<i64>()?, [0, 1, 42, 3]);
    // Its place is the archive, whose rows a view keeps.
    let rows = again.index(tensordict::Index::slice(Some(1), Some(3), 1))?;
    let backing = rows.backing()?;
    assert_eq!(backing.location, DictLocation::File(path.clone()));
    assert_eq!(backing.rows, Some(1..3));
    let reopened = backing.location.open(Access::ReadOnly)?;
    assert_eq!(reopened.get_tensor("action")?.to_vec::<i64>()?, [0, 1, 42, 3]);
    Ok(())
}

/// The entries of `saved.pt`, by name, in order.
fn entries() -> Vec<(String, Vec<u8>)> {
    let file = fs::File::open(formats().join("saved.pt")).unwrap();
    let mut archive = zip::ZipArchive::new(file).unwrap();
    (0..archive.len())
        .map(|i| {
            let mut entry = archive.by_index(i).unwrap();
            let mut bytes = Vec::new();
            entry.read_to_end(&mut bytes).unwrap();
            (entry.name().unwrap().into_owned(), bytes)
        })
        .collect()
}

/// An archive as torch writes one (stored entries, 64-byte aligned) of these entries.
fn archive(entries: &[(String, Vec<u8>)]) -> Vec<u8> {
    let mut zip = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
    let options =
        zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Stored).with_alignment(64);
    for (name, bytes) in entries {
        zip.start_file(name, options).unwrap();
        zip.write_all(bytes).unwrap();
    }
    zip.finish().unwrap().into_inner()
}

/// `saved.pt` with the entry `name` changed by `edit`.
fn edited(name: &str, edit: impl Fn(&[u8]) -> Vec<u8>) -> Vec<u8> {
    let entries: Vec<_> = entries()
        .into_iter()
        .map(|(n, bytes)| if n.ends_with(name) { (n, edit(&bytes)) } else { (n, bytes) })
        .collect();
    archive(&entries)
}

fn replaced(bytes: &[u8], from: &[u8], to: &[u8]) -> Vec<u8> {
    let at = bytes.windows(from.len()).position(|w| w == from).expect("the pickle holds it");
    [&bytes[..at], to, &bytes[at + from.len()..]].concat()
}

#[test]
fn hostile_archives_are_refused_with_one_error() {
    // The archive rebuilt from its own entries opens: the edits below are what is refused.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.pt");
    fs::write(&path, archive(&entries())).unwrap();
    TensorDict::open_consolidated(&path, Access::ReadOnly).expect("the rebuilt archive opens");

    let original = fs::read(formats().join("saved.pt")).unwrap();
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("not consolidated", fs::read(formats().join("saved_plain.pt")).unwrap(), "not a consolidated dict"),
        (
            "another call",
            edited("data.pkl", |p| {
                replaced(p, b"tensordict._reductions\n_rebuild_tensordict_files_consolidated\n", b"os\nsystem\n")
            }),
            "a call of `os.system`",
        ),
        (
            "another storage type",
            edited("data.pkl", |p| replaced(p, b"torch\nByteStorage\n", b"torch\nFloatStorage\n")),
            "not bytes",
        ),
        (
            "a storage key not torch's",
            edited("data.pkl", |p| replaced(p, b"X\x01\x00\x00\x000", b"X\x04\x00\x00\x00../0")),
            "storage key",
        ),
        (
            "a missing storage",
            archive(&entries().into_iter().filter(|(n, _)| !n.ends_with("data/0")).collect::<Vec<_>>()),
            "cannot be read",
        ),
        ("a short storage", edited("data/0", |d| d[..d.len() - 8].to_vec()), "the archive's entry holds"),
        ("a truncated pickle", edited("data.pkl", |p| p[..p.len() / 2].to_vec()), "ends early"),
        ("big-endian", edited("byteorder", |_| b"big".to_vec()), "big-endian"),
        ("no pickle", archive(&[("archive/data/0".into(), vec![0; 64])]), "data.pkl"),
        ("a truncated archive", original[..original.len() / 2].to_vec(), "torch.save archive"),
    ];
    for (what, bytes, says) in cases {
        fs::write(&path, &bytes).unwrap();
        let err = TensorDict::open_consolidated(&path, Access::ReadOnly).unwrap_err().to_string();
        assert!(err.contains(says), "{what}: `{err}` should say `{says}`");
    }
}
