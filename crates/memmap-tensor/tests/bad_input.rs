//! Bad files, names, sizes and layouts: each gives its specific error, never a fault.

mod common;
use common::{ShmName, TestResult};
use std::io::ErrorKind;
use std::os::unix::fs::PermissionsExt;
use std::sync::Arc;

use memmap_tensor::{Access, DType, Error, Layout, Location, Storage, Tensor};

#[test]
fn a_truncated_file_is_file_too_short() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("short.bin");
    std::fs::write(&path, [0u8; 10])?;
    for access in [Access::ReadOnly, Access::ReadWrite] {
        let err = Tensor::open_file(&path, DType::F32, [3], access).unwrap_err();
        assert!(
            matches!(&err, Error::FileTooShort { path: p, actual_bytes: 10, required_bytes: 12 } if *p == path),
            "{err:?}"
        );
        assert!(memmap_tensor::ErrorChain(&err).to_string().contains("short.bin"), "{err}");
    }
    // Exactly long enough, and longer, are fine; the extra bytes are ignored.
    assert_eq!(Tensor::open_file(&path, DType::U8, [2, 5], Access::ReadOnly)?.to_vec::<u8>()?, [0; 10]);
    assert_eq!(Tensor::open_file(&path, DType::I16, [4], Access::ReadOnly)?.to_vec::<i16>()?, [0; 4]);
    Ok(())
}

#[test]
fn a_missing_file_is_file_io_not_found() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("missing.bin");
    let err = Tensor::open_file(&path, DType::F32, [3], Access::ReadOnly).unwrap_err();
    assert!(
        matches!(&err, Error::FileIo { op: "open", path: p, source } if *p == path && source.kind() == ErrorKind::NotFound),
        "{err:?}"
    );
    assert!(std::error::Error::source(&err).is_some(), "the io error is the source");

    // Creating in a missing folder fails at "create".
    let nested = dir.path().join("no-such-dir").join("t.bin");
    let err = Tensor::zeros([2], DType::U8, &Location::File(nested)).unwrap_err();
    assert!(
        matches!(&err, Error::FileIo { op: "create", source, .. } if source.kind() == ErrorKind::NotFound),
        "{err:?}"
    );
    Ok(())
}

#[test]
fn writes_through_a_read_only_mapping_are_refused() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("ro.bin");
    let mut writer = Tensor::zeros([3, 2], DType::F32, &Location::File(path.clone()))?;
    writer.as_mut_slice::<f32>()?.copy_from_slice(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    drop(writer);

    let mut ro = Tensor::open_file(&path, DType::F32, [3, 2], Access::ReadOnly)?;
    assert!(!ro.storage().is_writable());
    let storage = path.display().to_string();
    let src = Tensor::from_slice(&[9.0f32, 9.0], [1, 2])?;
    assert!(matches!(
        ro.scatter_rows(&[0], &src),
        Err(Error::ReadOnly { op: "scatter_rows", storage: s }) if s == storage
    ));
    assert!(matches!(ro.as_mut_slice::<f32>(), Err(Error::ReadOnly { op: "as_mut_slice", .. })));
    assert!(matches!(ro.array_view_mut::<f32>(), Err(Error::ReadOnly { op: "array_view_mut", .. })));
    let copy = ro.deep_clone()?;
    assert!(matches!(ro.copy_from(&copy), Err(Error::ReadOnly { op: "copy_from", .. })));
    // A view that shares the storage is still read-only (the aliasing path copies aside first).
    let head = ro.narrow(0, 0, 1)?;
    assert!(matches!(ro.scatter_rows(&[2], &head), Err(Error::ReadOnly { op: "scatter_rows", .. })));
    // Reads work, and nothing changed.
    assert_eq!(ro.to_vec::<f32>()?, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    assert_eq!(&*ro.as_slice::<f32>()?, &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    ro.flush()?;
    Ok(())
}

#[test]
fn opening_a_read_only_file_for_writing_is_file_io() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("perm.bin");
    std::fs::write(&path, [0u8; 16])?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o444))?;
    // Read-only access is fine.
    assert_eq!(Tensor::open_file(&path, DType::U32, [4], Access::ReadOnly)?.to_vec::<u32>()?, [0; 4]);

    let result = Tensor::open_file(&path, DType::U32, [4], Access::ReadWrite);
    // Root (or CAP_DAC_OVERRIDE) bypasses file permissions: then the open succeeds.
    let bypassed = std::fs::OpenOptions::new().write(true).open(&path).is_ok();
    if bypassed {
        eprintln!("skipping the permission assertion: this process bypasses file permissions");
        assert!(result?.storage().is_writable());
    } else {
        let err = result.unwrap_err();
        assert!(
            matches!(&err, Error::FileIo { op: "open", path: p, source }
                if *p == path && source.kind() == ErrorKind::PermissionDenied),
            "{err:?}"
        );
    }
    Ok(())
}

#[test]
fn zero_size_tensors_on_heap_file_and_shm() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("empty.bin");
    let name = ShmName::new("bad");
    for location in [Location::Heap, Location::File(path.clone()), name.location()] {
        let mut t = Tensor::zeros([0, 84], DType::F32, &location)?;
        assert_eq!((t.elem_count(), t.nbytes(), t.storage().len_bytes()), (0, 0, 0), "{location:?}");
        assert!(t.to_vec::<f32>()?.is_empty());
        assert!(t.to_bytes()?.is_empty());
        assert!(t.as_slice::<f32>()?.is_empty());
        assert!(t.as_mut_slice::<f32>()?.is_empty());
        assert_eq!(t.array_view::<f32>()?.view().shape(), &[0, 84]);
        let gathered = t.gather_rows(&[])?;
        assert_eq!(gathered.dims(), &[0, 84]);
        t.scatter_rows(&[], &gathered)?;
        t.copy_rows(0..0, &gathered)?;
        assert!(matches!(t.gather_rows(&[0]), Err(Error::IndexOutOfRange { index: 0, size: 0, .. })));
        t.flush()?;
        assert_eq!(t.reshape([84, 0])?.dims(), &[84, 0]);
    }
    assert_eq!(std::fs::metadata(&path)?.len(), 0);

    // Zero rows of a non-empty tensor.
    let t = Tensor::from_slice(&[1u8, 2, 3, 4], [2, 2])?;
    let none = t.gather_rows(&[])?;
    assert_eq!(none.dims(), &[0, 2]);

    // A zero-length file or shm object opens as a tensor with no elements, but not as one with some.
    let reopened = Tensor::open_file(&path, DType::F32, [0, 3], Access::ReadWrite)?;
    assert_eq!(reopened.dims(), &[0, 3]);
    assert!(reopened.to_vec::<f32>()?.is_empty());
    assert!(matches!(
        Tensor::open_file(&path, DType::F32, [1, 3], Access::ReadOnly),
        Err(Error::FileTooShort { actual_bytes: 0, required_bytes: 12, .. })
    ));
    let from_shm = Tensor::open_shm(&name.0, DType::I64, [5, 0], Access::ReadOnly)?;
    assert_eq!(from_shm.elem_count(), 0);
    assert!(matches!(
        Tensor::open_shm(&name.0, DType::I64, [1], Access::ReadOnly),
        Err(Error::ShmTooShort { actual_bytes: 0, required_bytes: 8, .. })
    ));

    // A plain empty file made by someone else.
    let other = dir.path().join("touched.bin");
    std::fs::write(&other, [0u8; 0])?;
    assert_eq!(Tensor::open_file(&other, DType::U8, [0, 3], Access::ReadOnly)?.elem_count(), 0);
    Ok(())
}

#[test]
fn a_misaligned_typed_view_is_refused_but_copies_work() -> TestResult {
    let storage = Arc::new(Storage::heap(17)?);
    let values = [1.5f32, -2.0, 3.25, f32::MAX];
    // Write the f32 bytes at byte 1 through a u8 view of the same storage.
    let mut bytes = Tensor::from_storage(Arc::clone(&storage), 0, DType::U8, Layout::contiguous([17])?)?;
    bytes.as_mut_slice::<u8>()?[1..].copy_from_slice(bytemuck::cast_slice(&values));

    let mut t = Tensor::from_storage(Arc::clone(&storage), 1, DType::F32, Layout::contiguous([4])?)?;
    assert_eq!(t.byte_offset(), 1);
    assert!(matches!(
        t.as_slice::<f32>(),
        Err(Error::Misaligned { op: "as_slice", align: 4, dtype: DType::F32, addr }) if addr % 4 == 1
    ));
    assert!(matches!(t.as_mut_slice::<f32>(), Err(Error::Misaligned { op: "as_mut_slice", .. })));
    assert!(matches!(t.array_view::<f32>(), Err(Error::Misaligned { op: "array_view", .. })));
    assert!(matches!(t.array_view_mut::<f32>(), Err(Error::Misaligned { op: "array_view_mut", .. })));
    // Element copies do not care about alignment.
    assert_eq!(t.to_vec::<f32>()?, values);
    assert_eq!(t.to_bytes()?, bytemuck::cast_slice::<f32, u8>(&values));
    assert_eq!(t.gather_rows(&[3, 0])?.to_vec::<f32>()?, [f32::MAX, 1.5]);
    let aligned = t.deep_clone()?;
    assert_eq!(&*aligned.as_slice::<f32>()?, &values);
    t.scatter_rows(&[0], &Tensor::from_slice(&[7.0f32], [1])?)?;
    assert_eq!(t.to_vec::<f32>()?, [7.0, -2.0, 3.25, f32::MAX]);
    Ok(())
}

#[test]
fn from_storage_past_the_end_is_layout_out_of_bounds() -> TestResult {
    let storage = Arc::new(Storage::heap(16)?);
    let check = |byte_offset, layout: Layout, required: u64| {
        matches!(
            Tensor::from_storage(Arc::clone(&storage), byte_offset, DType::F32, layout),
            Err(Error::LayoutOutOfBounds { required_bytes, storage_bytes: 16 }) if required_bytes == required
        )
    };
    assert!(check(0, Layout::contiguous([5])?, 20));
    assert!(check(4, Layout::contiguous([4])?, 20));
    assert!(check(0, Layout::new([2], vec![4], 0)?, 20));
    assert!(check(0, Layout::new([1], vec![1], 4)?, 20));
    assert!(check(17, Layout::contiguous([0])?, 17));
    // Exactly filling the storage is fine.
    assert_eq!(Tensor::from_storage(Arc::clone(&storage), 4, DType::F32, Layout::contiguous([3])?)?.elem_count(), 3);
    assert_eq!(Tensor::from_storage(Arc::clone(&storage), 16, DType::F32, Layout::contiguous([0, 7])?)?.nbytes(), 0);
    Ok(())
}

#[test]
fn invalid_shm_names_are_refused() -> TestResult {
    let long = format!("/{}", "a".repeat(256));
    for name in ["noslash", "/a/b", "/..", "/.", "/", "", "/a\0b", long.as_str()] {
        let is_invalid = |err: &Error| matches!(err, Error::InvalidShmName { name: n, .. } if n == name);
        let err = Tensor::zeros([2], DType::U8, &Location::Shm(name.to_owned())).unwrap_err();
        assert!(is_invalid(&err), "create {name:?}: {err:?}");
        let err = Tensor::open_shm(name, DType::U8, [2], Access::ReadOnly).unwrap_err();
        assert!(is_invalid(&err), "open {name:?}: {err:?}");
        let err = Storage::unlink_shm(name).unwrap_err();
        assert!(is_invalid(&err), "unlink {name:?}: {err:?}");
    }
    Ok(())
}

#[test]
fn a_missing_shm_object_is_shm_io() -> TestResult {
    let name = ShmName::new("bad");
    let err = Tensor::open_shm(&name.0, DType::U8, [2], Access::ReadOnly).unwrap_err();
    assert!(
        matches!(&err, Error::ShmIo { op: "shm_open", name: n, source } if *n == name.0 && source.kind() == ErrorKind::NotFound),
        "{err:?}"
    );
    let err = Storage::unlink_shm(&name.0).unwrap_err();
    assert!(
        matches!(&err, Error::ShmIo { op: "shm_unlink", source, .. } if source.kind() == ErrorKind::NotFound),
        "{err:?}"
    );
    Ok(())
}

#[test]
fn creating_an_existing_shm_name_is_shm_io() -> TestResult {
    let name = ShmName::new("bad");
    let mut first = Tensor::zeros([4], DType::I32, &name.location())?;
    first.as_mut_slice::<i32>()?.copy_from_slice(&[1, 2, 3, 4]);
    let err = Tensor::zeros([4], DType::I32, &name.location()).unwrap_err();
    assert!(
        matches!(&err, Error::ShmIo { op: "shm_open", name: n, source }
            if *n == name.0 && source.kind() == ErrorKind::AlreadyExists),
        "{err:?}"
    );
    // The failed create neither unlinked nor cleared the existing object.
    assert_eq!(Tensor::open_shm(&name.0, DType::I32, [4], Access::ReadOnly)?.to_vec::<i32>()?, [1, 2, 3, 4]);
    assert_eq!(first.to_vec::<i32>()?, [1, 2, 3, 4]);
    Ok(())
}

#[test]
fn an_undersized_shm_object_is_shm_too_short() -> TestResult {
    let name = ShmName::new("bad");
    let _small = Tensor::zeros([2], DType::F32, &name.location())?;
    let err = Tensor::open_shm(&name.0, DType::F32, [3], Access::ReadOnly).unwrap_err();
    assert!(
        matches!(&err, Error::ShmTooShort { name: n, actual_bytes: 8, required_bytes: 12 } if *n == name.0),
        "{err:?}"
    );
    // A smaller or equal request maps fine.
    assert_eq!(Tensor::open_shm(&name.0, DType::U8, [8], Access::ReadWrite)?.elem_count(), 8);
    Ok(())
}

#[test]
fn shm_opened_read_only_refuses_writes() -> TestResult {
    let name = ShmName::new("bad");
    let _owner = Tensor::zeros([2, 2], DType::U16, &name.location())?;
    let mut ro = Tensor::open_shm(&name.0, DType::U16, [2, 2], Access::ReadOnly)?;
    let storage = format!("shm:{}", name.0);
    assert!(
        matches!(ro.as_mut_slice::<u16>(), Err(Error::ReadOnly { op: "as_mut_slice", storage: s }) if s == storage)
    );
    let src = Tensor::from_slice(&[1u16, 2], [1, 2])?;
    assert!(matches!(ro.scatter_rows(&[1], &src), Err(Error::ReadOnly { .. })));
    assert_eq!(ro.to_vec::<u16>()?, [0; 4]);
    Ok(())
}

#[test]
fn create_file_over_a_mapped_file_leaves_the_old_mapping_intact() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("replaced.bin");
    let mut old = Tensor::zeros([4], DType::I32, &Location::File(path.clone()))?;
    old.as_mut_slice::<i32>()?.copy_from_slice(&[1, 2, 3, 4]);
    old.flush()?;
    let old_reader = Tensor::open_file(&path, DType::I32, [4], Access::ReadOnly)?;

    // A larger file replaces the smaller one: the old mappings must not fault or change.
    let new = Tensor::zeros([8], DType::I32, &Location::File(path.clone()))?;
    assert_eq!(new.to_vec::<i32>()?, [0; 8]);
    assert_eq!(old.to_vec::<i32>()?, [1, 2, 3, 4]);
    assert_eq!(old_reader.to_vec::<i32>()?, [1, 2, 3, 4]);

    // And a smaller one replaces that: still no SIGBUS on the 8-element mapping.
    let newest = Tensor::zeros([1], DType::I32, &Location::File(path.clone()))?;
    assert_eq!(new.to_vec::<i32>()?, [0; 8]);
    assert_eq!(newest.to_vec::<i32>()?, [0]);

    // Writes to the old tensor go to the old (unlinked) file only.
    old.as_mut_slice::<i32>()?.copy_from_slice(&[5, 6, 7, 8]);
    assert_eq!(old_reader.to_vec::<i32>()?, [5, 6, 7, 8]);
    assert_eq!(newest.to_vec::<i32>()?, [0]);
    assert_eq!(std::fs::read(&path)?, [0; 4]);
    assert_eq!(Tensor::open_file(&path, DType::I32, [1], Access::ReadOnly)?.to_vec::<i32>()?, [0]);

    // No temporary files are left beside it.
    let names: Vec<_> = std::fs::read_dir(dir.path())?.map(|e| e.map(|e| e.file_name())).collect::<Result<_, _>>()?;
    assert_eq!(names, ["replaced.bin"]);
    Ok(())
}

#[test]
fn non_regular_files_are_refused_without_blocking() -> TestResult {
    let dir = tempfile::tempdir()?;
    let is_open_error = |r: memmap_tensor::Result<Tensor>| matches!(r, Err(Error::FileIo { op: "open", .. }));

    // A directory.
    let result = Tensor::open_file(dir.path(), DType::U8, [0], Access::ReadOnly);
    assert!(
        matches!(&result, Err(Error::FileIo { op: "open", source, .. }) if source.kind() == ErrorKind::InvalidInput),
        "{result:?}"
    );
    assert!(is_open_error(Tensor::open_file(dir.path(), DType::U8, [0], Access::ReadWrite)));

    // A FIFO with no writer: a blocking open would hang here.
    let fifo = dir.path().join("fifo");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRUSR | nix::sys::stat::Mode::S_IWUSR)?;
    for access in [Access::ReadOnly, Access::ReadWrite] {
        let result = Tensor::open_file(&fifo, DType::U8, [0], access);
        assert!(
            matches!(&result, Err(Error::FileIo { op: "open", path, source })
                if *path == fifo && source.kind() == ErrorKind::InvalidInput),
            "{access:?}: {result:?}"
        );
    }
    Ok(())
}

/// A mapping can be far larger than memory; copying it out is an error, not an abort.
#[test]
fn to_vec_of_a_leaf_larger_than_memory_is_an_error() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("huge.bin");
    let file = std::fs::File::create(&path)?;
    file.set_len(1 << 40)?; // sparse: no blocks are used
    let t = Tensor::open_file(&path, DType::U8, [1usize << 40], Access::ReadOnly)?;
    let err = t.to_vec::<u8>().unwrap_err();
    // 1 TiB is more than this machine has: refused before anything is allocated.
    assert!(matches!(err, Error::TooLarge { what: "to_vec", count, each: 1, .. } if count == 1 << 40), "{err:?}");
    Ok(())
}

/// Opening a file keeps no descriptor: thousands of leaves fit in a small descriptor limit.
#[test]
fn mapped_files_hold_no_descriptor() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("t.bin");
    std::fs::write(&path, [7u8; 64])?;
    let fd_target = |fd: &std::fs::DirEntry| std::fs::read_link(fd.path()).ok();
    let tensors: Vec<Tensor> =
        (0..50).map(|_| Tensor::open_file(&path, DType::U8, [64], Access::ReadOnly)).collect::<Result<_, _>>()?;
    // Other tests run in this process at the same time, so count only descriptors of this file.
    let open_here = std::fs::read_dir("/proc/self/fd")?
        .filter_map(Result::ok)
        .filter(|fd| fd_target(fd).is_some_and(|target| target == path))
        .count();
    assert_eq!(open_here, 0, "descriptors of {} still open", path.display());
    assert_eq!(tensors[49].to_vec::<u8>()?, [7u8; 64]);
    Ok(())
}

/// I/O that bypasses the mapping reopens the mapped file, and refuses a file that replaced it.
#[test]
fn reopen_file_refuses_a_replaced_file() -> TestResult {
    use std::io::Read;
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("t.bin");
    std::fs::write(&path, [1u8; 16])?;
    let t = Tensor::open_file(&path, DType::U8, [16], Access::ReadOnly)?;
    let mut bytes = Vec::new();
    t.storage().reopen_file(0)?.read_to_end(&mut bytes)?;
    assert_eq!(bytes, [1u8; 16]);

    let tmp = dir.path().join("t.new");
    std::fs::write(&tmp, [2u8; 16])?;
    std::fs::rename(&tmp, &path)?;
    let err = t.storage().reopen_file(0).unwrap_err();
    assert!(memmap_tensor::ErrorChain(&err).to_string().contains("replaced"), "{err}");
    assert!(matches!(
        Tensor::zeros([2], DType::U8, &Location::Heap)?.storage().reopen_file(0),
        Err(Error::NotAFile { .. })
    ));
    Ok(())
}

/// `to_bytes` of a leaf larger than memory is an error too.
#[test]
fn to_bytes_of_a_leaf_larger_than_memory_is_an_error() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("huge.bin");
    std::fs::File::create(&path)?.set_len(1 << 40)?;
    let t = Tensor::open_file(&path, DType::U8, [1usize << 40], Access::ReadOnly)?;
    assert!(matches!(t.to_bytes(), Err(Error::TooLarge { count, each: 1, .. }) if count == 1 << 40));
    assert!(matches!(t.to_vec_bool(), Err(Error::DTypeMismatch { .. })));
    Ok(())
}

/// `/dev/shm` is writable by everyone: a FIFO planted under an expected name is refused at
/// once, by every way of opening an existing object.
#[test]
fn a_fifo_in_dev_shm_is_refused_without_blocking() -> TestResult {
    let name = format!("/tdict-fifo-{}", std::process::id());
    let path = format!("/dev/shm{name}");
    nix::unistd::mkfifo(path.as_str(), nix::sys::stat::Mode::S_IRUSR | nix::sys::stat::Mode::S_IWUSR)?;
    let (tx, rx) = std::sync::mpsc::channel();
    let probe = name.clone();
    std::thread::spawn(move || {
        let _ = tx.send((
            Storage::open_shm(&probe, Access::ReadOnly, 0).map(drop),
            Storage::open_shm(&probe, Access::ReadWrite, 0).map(drop),
            Storage::read_shm_bytes(&probe, 16).map(drop),
        ));
    });
    let results = rx.recv_timeout(std::time::Duration::from_secs(10));
    std::fs::remove_file(&path)?;
    let (ro, rw, bytes) = results.map_err(|_| "opening a FIFO in /dev/shm blocked")?;
    for result in [ro, rw, bytes] {
        let err = result.expect_err("a FIFO opened as shared memory");
        assert!(memmap_tensor::ErrorChain(&err).to_string().contains("not a regular file"), "{err}");
    }
    Ok(())
}
