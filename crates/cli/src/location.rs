//! Where a dict lives, as given on the command line: the one parser every subcommand uses, so
//! that `shm:PREFIX` means a shared dict everywhere.

use std::ffi::OsStr;
use std::path::PathBuf;

use clap::builder::TypedValueParser;
use memmap_tensor::Access;
use tensordict::TensorDict;

/// A memmap folder or a shared dict.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Location {
    /// A folder (any path that does not start with `shm:`).
    Folder(PathBuf),
    /// A dict in shared memory, `shm:PREFIX`: the prefix.
    Shm(String),
}

impl Location {
    /// `shm:PREFIX` is a shared dict, anything else a folder. A prefix must be UTF-8 (it is
    /// checked further by the library when used).
    pub(crate) fn parse(arg: &OsStr) -> Result<Location, String> {
        if !arg.as_encoded_bytes().starts_with(b"shm:") {
            return Ok(Location::Folder(PathBuf::from(arg)));
        }
        let text = arg.to_str().ok_or_else(|| format!("{}: the prefix is not UTF-8", arg.display()))?;
        Ok(Location::Shm(text["shm:".len()..].to_owned()))
    }

    /// Opens the dict.
    pub(crate) fn open(&self, access: Access) -> anyhow::Result<TensorDict> {
        Ok(match self {
            Location::Folder(path) => TensorDict::load_memmap(path, access)?,
            Location::Shm(prefix) => TensorDict::open_shared(prefix, access)?,
        })
    }
}

impl std::fmt::Display for Location {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Location::Folder(path) => write!(f, "{}", path.display()),
            Location::Shm(prefix) => write!(f, "shm:{prefix}"),
        }
    }
}

/// [`Location::parse`] for clap: a bad location is a usage error (exit 2).
#[derive(Clone, Copy, Debug)]
pub(crate) struct LocationParser;

impl TypedValueParser for LocationParser {
    type Value = Location;

    fn parse_ref(&self, cmd: &clap::Command, arg: Option<&clap::Arg>, value: &OsStr) -> Result<Location, clap::Error> {
        Location::parse(value).map_err(|reason| {
            let name = arg.map_or_else(|| "LOCATION".to_owned(), ToString::to_string);
            clap::Error::raw(clap::error::ErrorKind::ValueValidation, format!("invalid value for {name}: {reason}\n"))
                .with_cmd(cmd)
        })
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::ffi::OsStrExt;

    use super::*;

    #[test]
    fn shm_prefix_or_folder() {
        assert_eq!(Location::parse(OsStr::new("shm:abc")), Ok(Location::Shm("abc".into())));
        assert_eq!(Location::parse(OsStr::new("shm:")), Ok(Location::Shm(String::new())));
        assert_eq!(Location::parse(OsStr::new("./shm:abc")), Ok(Location::Folder("./shm:abc".into())));
        assert_eq!(Location::parse(OsStr::new("/tmp/x")), Ok(Location::Folder("/tmp/x".into())));
        assert_eq!(Location::parse(OsStr::new("SHM:x")), Ok(Location::Folder("SHM:x".into())));
        assert!(Location::parse(OsStr::from_bytes(b"shm:\xff")).is_err());
        let odd = OsStr::from_bytes(b"/tmp/\xff");
        assert_eq!(Location::parse(odd), Ok(Location::Folder(odd.into())));
    }
}
