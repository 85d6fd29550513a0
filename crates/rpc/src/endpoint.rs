//! Where a server listens: a named Unix socket in a private per-user directory, or a TCP address.
//!
//! # The runtime directory
//!
//! A Unix socket *name* (`uds:NAME`) becomes the path `DIR/NAME.sock`, where `DIR` is the first of:
//!
//! 1. the directory given in the options ([`ServerOptions::runtime_dir`],
//!    [`ClientOptions::runtime_dir`]);
//! 2. the environment variable [`RUNTIME_DIR_ENV`] (`TDICT_RUNTIME_DIR`);
//! 3. `$XDG_RUNTIME_DIR/tensordict-rs`, when `XDG_RUNTIME_DIR` is set to an absolute path of a
//!    directory owned by this user;
//! 4. `/tmp/tensordict-rs-<uid>`.
//!
//! The directory is created with mode 0700 if it is missing. It is refused, with an error naming
//! it, if it is a symbolic link, not a directory, owned by another uid, or accessible to group or
//! others: then nobody else can place, replace or reach our sockets there.
//!
//! [`ServerOptions::runtime_dir`]: crate::ServerOptions::runtime_dir
//! [`ClientOptions::runtime_dir`]: crate::ClientOptions::runtime_dir

use std::fmt;
use std::fs;
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::str::FromStr;

use crate::error::{Error, Result};

/// The environment variable that overrides the runtime directory holding Unix sockets.
pub const RUNTIME_DIR_ENV: &str = "TDICT_RUNTIME_DIR";

/// The longest socket name accepted, in bytes.
pub const MAX_SOCKET_NAME_BYTES: usize = 64;

/// Bytes of a socket path that fit in `sockaddr_un::sun_path` (108, less the trailing NUL).
const MAX_SOCKET_PATH_BYTES: usize = 107;

/// Where a server listens and a client connects.
///
/// Parsed from `uds:NAME` or `tcp:HOST:PORT` (`tcp:127.0.0.1:7000`, `tcp:[::1]:7000`,
/// `tcp:localhost:7000`); printed back in the same form.
///
/// ```
/// use tensordict_rpc::Endpoint;
/// let uds: Endpoint = "uds:replay".parse()?;
/// assert_eq!(uds, Endpoint::Uds("replay".into()));
/// let tcp: Endpoint = "tcp:127.0.0.1:7000".parse()?;
/// assert_eq!(tcp.to_string(), "tcp:127.0.0.1:7000");
/// assert!("uds:a/b".parse::<Endpoint>().is_err());
/// # Ok::<(), tensordict_rpc::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Endpoint {
    /// A Unix socket named in the per-user runtime directory (see the [module docs](self)).
    /// Only processes of the same uid are served.
    Uds(String),
    /// A TCP address `HOST:PORT`. Needs a shared token; the traffic is not encrypted.
    Tcp(String),
}

impl Endpoint {
    /// The socket path of a [`Endpoint::Uds`] endpoint, resolving (and creating, mode 0700) the
    /// runtime directory; `runtime_dir` overrides it as described in the [module docs](self).
    /// `None` for TCP endpoints.
    pub fn socket_path(&self, runtime_dir: Option<&Path>) -> Result<Option<PathBuf>> {
        match self {
            Endpoint::Uds(name) => {
                validate_socket_name(name)?;
                let dir = resolve_runtime_dir(runtime_dir)?;
                let path = dir.join(format!("{name}.sock"));
                check_socket_path_len(&path)?;
                Ok(Some(path))
            }
            Endpoint::Tcp(_) => Ok(None),
        }
    }

    /// Checks the endpoint's text: a valid socket name, or `HOST:PORT` with a port number.
    pub fn validate(&self) -> Result<()> {
        match self {
            Endpoint::Uds(name) => validate_socket_name(name),
            Endpoint::Tcp(addr) => {
                validate_tcp_addr(addr).map_err(|reason| Error::InvalidEndpoint { input: self.to_string(), reason })
            }
        }
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Endpoint::Uds(name) => write!(f, "uds:{name}"),
            Endpoint::Tcp(addr) => write!(f, "tcp:{addr}"),
        }
    }
}

impl FromStr for Endpoint {
    type Err = Error;

    fn from_str(input: &str) -> Result<Self> {
        let invalid = |reason: String| Error::InvalidEndpoint { input: input.to_string(), reason };
        if let Some(name) = input.strip_prefix("uds:") {
            let endpoint = Endpoint::Uds(name.to_string());
            endpoint.validate()?;
            Ok(endpoint)
        } else if let Some(addr) = input.strip_prefix("tcp:") {
            validate_tcp_addr(addr).map_err(invalid)?;
            Ok(Endpoint::Tcp(addr.to_string()))
        } else {
            Err(invalid("expected `uds:NAME` or `tcp:HOST:PORT`".into()))
        }
    }
}

fn validate_tcp_addr(addr: &str) -> std::result::Result<(), String> {
    let Some((host, port)) = addr.rsplit_once(':') else {
        return Err("expected HOST:PORT".into());
    };
    if host.is_empty() {
        return Err("the host is empty".into());
    }
    if port.parse::<u16>().is_err() {
        return Err(format!("port `{port}` is not a number from 0 to 65535"));
    }
    let bracketed = host.starts_with('[') && host.ends_with(']');
    if host.contains(':') && !bracketed {
        return Err("write an IPv6 host in brackets, as in `[::1]:7000`".into());
    }
    Ok(())
}

/// Checks a socket name: 1 to [`MAX_SOCKET_NAME_BYTES`] bytes of `A-Z a-z 0-9 . _ -`, not
/// starting with a dot.
pub(crate) fn validate_socket_name(name: &str) -> Result<()> {
    let invalid = |reason: String| Error::InvalidSocketName { name: name.to_string(), reason };
    if name.is_empty() {
        return Err(invalid("the name is empty".into()));
    }
    if name.len() > MAX_SOCKET_NAME_BYTES {
        return Err(invalid(format!("{} bytes, more than {MAX_SOCKET_NAME_BYTES}", name.len())));
    }
    if name.starts_with('.') {
        return Err(invalid("the name starts with a dot".into()));
    }
    if let Some(bad) = name.chars().find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))) {
        return Err(invalid(format!("character {bad:?} is not allowed (use A-Z a-z 0-9 . _ -)")));
    }
    Ok(())
}

fn check_socket_path_len(path: &Path) -> Result<()> {
    let len = path.as_os_str().len();
    if len > MAX_SOCKET_PATH_BYTES {
        return Err(Error::SocketPathTooLong { path: path.to_path_buf(), len, max: MAX_SOCKET_PATH_BYTES });
    }
    Ok(())
}

/// This process's effective uid.
pub(crate) fn current_uid() -> u32 {
    nix::unistd::geteuid().as_raw()
}

/// The name stem of the shared-memory objects a `kind` of service (`store`, `replay`) called
/// `name` makes: `tdict-KIND-UID-HASH-NAME`, the uid and the runtime directory (hashed) keeping
/// services of other users and other runtime directories apart, so that a service removes only
/// what an earlier service of its own kind and name left.
pub fn shm_stem(kind: &str, runtime_dir: &Path, name: &str) -> String {
    // FNV-1a: stable across builds, which is all that matters here.
    let hash = runtime_dir
        .as_os_str()
        .as_encoded_bytes()
        .iter()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
    format!("tdict-{kind}-{}-{:08x}-{name}", current_uid(), hash as u32)
}

/// Whether `prefix` has the form of a service's shared-memory stem ([`shm_stem`]):
/// `tdict-replay-` or `tdict-store-`, a uid, 8 hex digits, `-` and a service name.
pub fn is_service_stem(prefix: &str) -> bool {
    let Some(rest) = prefix.strip_prefix("tdict-replay-").or_else(|| prefix.strip_prefix("tdict-store-")) else {
        return false;
    };
    let mut parts = rest.splitn(3, '-');
    let (Some(uid), Some(hash), Some(name)) = (parts.next(), parts.next(), parts.next()) else { return false };
    !uid.is_empty()
        && uid.bytes().all(|b| b.is_ascii_digit())
        && hash.len() == 8
        && hash.bytes().all(|b| b.is_ascii_hexdigit())
        && !name.is_empty()
}

/// Resolves the runtime directory (option, then environment, then XDG, then `/tmp`), creates it
/// with mode 0700 if missing, and checks it is a private directory of this uid.
///
/// This is where [`Endpoint::Uds`] sockets go; see the [module docs](self).
pub fn resolve_runtime_dir(runtime_dir: Option<&Path>) -> Result<PathBuf> {
    let uid = current_uid();
    let dir = if let Some(dir) = runtime_dir {
        dir.to_path_buf()
    } else if let Some(dir) = std::env::var_os(RUNTIME_DIR_ENV).filter(|v| !v.is_empty()) {
        PathBuf::from(dir)
    } else if let Some(xdg) = usable_xdg_runtime_dir(uid) {
        xdg.join("tensordict-rs")
    } else {
        PathBuf::from(format!("/tmp/tensordict-rs-{uid}"))
    };
    ensure_private_dir(&dir, uid)?;
    Ok(dir)
}

fn usable_xdg_runtime_dir(uid: u32) -> Option<PathBuf> {
    let dir = PathBuf::from(std::env::var_os("XDG_RUNTIME_DIR")?);
    if !dir.is_absolute() {
        return None;
    }
    let meta = fs::metadata(&dir).ok()?;
    (meta.is_dir() && meta.uid() == uid).then_some(dir)
}

/// Creates `dir` (mode 0700, parents as needed) if it is missing, then checks that it is a
/// directory, not a symbolic link, owned by `uid`, with no group or other permission bits.
pub(crate) fn ensure_private_dir(dir: &Path, uid: u32) -> Result<()> {
    let io_err = |source: io::Error| Error::RuntimeDirIo { path: dir.to_path_buf(), source };
    match fs::DirBuilder::new().recursive(true).mode(0o700).create(dir) {
        Ok(()) => {}
        // `create` follows a symbolic link to a directory and succeeds; the check below refuses
        // it. Any other failure (a file in the way, a symlink to nowhere) is reported by the
        // check when the path exists.
        Err(_) if fs::symlink_metadata(dir).is_ok() => {}
        Err(source) => return Err(io_err(source)),
    }
    let meta = fs::symlink_metadata(dir).map_err(io_err)?;
    if meta.file_type().is_symlink() {
        return Err(Error::RuntimeDirSymlink { path: dir.to_path_buf() });
    }
    if !meta.is_dir() {
        return Err(Error::RuntimeDirNotDirectory { path: dir.to_path_buf() });
    }
    if meta.uid() != uid {
        return Err(Error::RuntimeDirOwner { path: dir.to_path_buf(), owner: meta.uid(), uid });
    }
    let mode = meta.mode() & 0o7777;
    if mode & 0o077 != 0 {
        return Err(Error::RuntimeDirMode { path: dir.to_path_buf(), mode });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_and_print() {
        for text in ["uds:a", "uds:replay-1.main_2", "tcp:127.0.0.1:0", "tcp:[::1]:7000", "tcp:localhost:65535"] {
            let endpoint: Endpoint = text.parse().unwrap();
            assert_eq!(endpoint.to_string(), text);
        }
    }

    #[test]
    fn parse_rejects() {
        let long = format!("uds:{}", "a".repeat(MAX_SOCKET_NAME_BYTES + 1));
        for text in [
            "",
            "uds:",
            "uds:a/b",
            "uds:..",
            "uds:.hidden",
            "uds:a b",
            "uds:a\0b",
            &long,
            "tcp:",
            "tcp:host",
            "tcp::80",
            "tcp:host:http",
            "tcp:host:65536",
            "tcp:::1:80",
            "unix:a",
        ] {
            assert!(text.parse::<Endpoint>().is_err(), "{text:?} was accepted");
        }
    }

    #[test]
    fn too_long_path_is_refused() {
        let deep = PathBuf::from(format!("/tmp/{}", "d".repeat(100)));
        let err = check_socket_path_len(&deep.join("name.sock")).unwrap_err();
        assert!(matches!(err, Error::SocketPathTooLong { max: 107, .. }), "{err}");
    }
}
