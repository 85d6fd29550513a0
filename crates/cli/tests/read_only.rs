//! `tdict info`, `verify` and `copy` read a dict on a read-only filesystem (a read-only bind
//! mount; needs root, else one `skipped: why` line) and leave its folder as it was.

use std::ffi::OsStr;

use integration_tests::read_only::{ReadOnlyMount, check_unchanged, folder_state};
use tensordict::TensorDict;

mod common;
#[allow(clippy::wildcard_imports)]
use common::*;

#[test]
fn info_verify_and_copy_read_a_read_only_mount() -> anyhow::Result<()> {
    let Some(mount) = ReadOnlyMount::new("tdict on a read-only mount")? else { return Ok(()) };
    integration_tests::version(4)?.memmap(mount.source().join("data"))?;
    let out = tempfile::tempdir()?;
    let before = folder_state(mount.source())?;
    for (i, root) in [mount.view(), mount.source()].into_iter().enumerate() {
        let data = root.join("data");
        let info = tdict([OsStr::new("info"), data.as_os_str(), "--json".as_ref(), "--stats".as_ref()]).json();
        assert_eq!(info["batch_size"], serde_json::json!([integration_tests::version_rows(4)]), "{info}");
        tdict([OsStr::new("verify"), data.as_os_str()]).ok();
        let copy = out.path().join(format!("copy-{i}"));
        tdict([OsStr::new("copy"), data.as_os_str(), copy.as_os_str()]).ok();
        integration_tests::check_version(&TensorDict::read_memmap(&copy)?, false)?;
        check_unchanged(mount.source(), &before, "tdict info, verify and copy")?;
    }
    // A copy into the read-only mount is refused in one line that says why.
    let into = mount.view().join("copy");
    let source = mount.source().join("data");
    let refused = tdict([OsStr::new("copy"), source.as_os_str(), into.as_os_str()]);
    assert!(refused.one_line_error().contains("Read-only file system"), "{refused}");
    Ok(())
}
