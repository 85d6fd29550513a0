//! The shared token of TCP endpoints and the proofs computed from it.
//!
//! A TCP connection starts with a mutual challenge-response (see [`crate::transport`]): each side
//! sends a fresh random nonce, and each proves it knows the token with
//! `HMAC-SHA256(token, context || server_nonce || client_nonce)`, where the context string differs
//! for the client's and the server's proof, so that neither proof can be reflected back. The token
//! itself never crosses the wire. Proofs are compared in constant time.

use std::fmt;
use std::fs;
use std::io::Read;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::Path;

use hmac::{Hmac, Mac};
use rand::RngCore;
use sha2::Sha256;

use crate::error::{Error, Result};

/// The fewest bytes a token may have.
pub const MIN_TOKEN_BYTES: usize = 16;

/// The largest token file accepted, in bytes.
pub const MAX_TOKEN_FILE_BYTES: u64 = 4096;

/// Bytes of a nonce and of a proof.
pub(crate) const NONCE_BYTES: usize = 32;
pub(crate) const PROOF_BYTES: usize = 32;

const CLIENT_CONTEXT: &[u8] = b"tensordict-rs rpc v1: client proof";
const SERVER_CONTEXT: &[u8] = b"tensordict-rs rpc v1: server proof";

/// A shared secret that authorizes TCP clients and servers.
///
/// Its bytes are never printed (`Debug` shows only the length) and never sent.
///
/// ```
/// use tensordict_rpc::Token;
/// let token = Token::from_bytes(b"a long enough shared secret".to_vec())?;
/// assert!(Token::from_bytes(b"short".to_vec()).is_err());
/// # let _ = token;
/// # Ok::<(), tensordict_rpc::Error>(())
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct Token {
    bytes: Vec<u8>,
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Token({} bytes)", self.bytes.len())
    }
}

impl Token {
    /// A token from its bytes; at least [`MIN_TOKEN_BYTES`] long.
    pub fn from_bytes(bytes: impl Into<Vec<u8>>) -> Result<Token> {
        let bytes = bytes.into();
        if bytes.len() < MIN_TOKEN_BYTES {
            return Err(Error::TokenTooShort { len: bytes.len(), min: MIN_TOKEN_BYTES });
        }
        Ok(Token { bytes })
    }

    /// Reads a token from a file: a regular file (symbolic links are not followed) of at most
    /// [`MAX_TOKEN_FILE_BYTES`], with no group or other permission bits (`chmod 600`). Trailing
    /// whitespace (a final newline) is not part of the token.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Token> {
        let path = path.as_ref();
        let io_err = |source| Error::TokenFileIo { path: path.to_path_buf(), source };
        // O_NOFOLLOW: a symbolic link is refused; O_NONBLOCK: a FIFO put in its place does not
        // hang the open (it is then refused as not regular).
        let file = fs::OpenOptions::new()
            .read(true)
            .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK)
            .open(path)
            .map_err(io_err)?;
        let meta = file.metadata().map_err(io_err)?;
        if !meta.is_file() {
            return Err(Error::TokenFileNotRegular { path: path.to_path_buf() });
        }
        let mode = meta.mode() & 0o7777;
        if mode & 0o077 != 0 {
            return Err(Error::TokenFilePermissions { path: path.to_path_buf(), mode });
        }
        if meta.len() > MAX_TOKEN_FILE_BYTES {
            return Err(Error::TokenFileTooLarge {
                path: path.to_path_buf(),
                len: meta.len(),
                max: MAX_TOKEN_FILE_BYTES,
            });
        }
        let mut bytes = Vec::new();
        // The file may grow after the check: read one byte more than allowed to notice.
        file.take(MAX_TOKEN_FILE_BYTES + 1).read_to_end(&mut bytes).map_err(io_err)?;
        if bytes.len() as u64 > MAX_TOKEN_FILE_BYTES {
            return Err(Error::TokenFileTooLarge {
                path: path.to_path_buf(),
                len: bytes.len() as u64,
                max: MAX_TOKEN_FILE_BYTES,
            });
        }
        while bytes.last().is_some_and(u8::is_ascii_whitespace) {
            bytes.pop();
        }
        Token::from_bytes(bytes)
    }

    /// A new random token: 32 random bytes written as 64 hexadecimal characters, so it can be
    /// stored in a text file and passed to [`Token::from_file`].
    pub fn generate() -> Token {
        let mut raw = [0u8; 32];
        rand::rng().fill_bytes(&mut raw);
        let hex: String = raw.iter().map(|b| format!("{b:02x}")).collect();
        Token { bytes: hex.into_bytes() }
    }

    /// The token's bytes, to store it (in a file of mode 0600).
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes
    }

    fn mac(&self, context: &[u8], server_nonce: &[u8], client_nonce: &[u8]) -> Hmac<Sha256> {
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.bytes).expect("HMAC accepts keys of any length");
        mac.update(context);
        mac.update(server_nonce);
        mac.update(client_nonce);
        mac
    }

    /// The client's proof for this pair of nonces.
    pub(crate) fn client_proof(&self, server_nonce: &[u8], client_nonce: &[u8]) -> [u8; PROOF_BYTES] {
        self.mac(CLIENT_CONTEXT, server_nonce, client_nonce).finalize().into_bytes().into()
    }

    /// The server's proof for this pair of nonces.
    pub(crate) fn server_proof(&self, server_nonce: &[u8], client_nonce: &[u8]) -> [u8; PROOF_BYTES] {
        self.mac(SERVER_CONTEXT, server_nonce, client_nonce).finalize().into_bytes().into()
    }

    /// Checks a client's proof in constant time.
    pub(crate) fn verify_client(&self, server_nonce: &[u8], client_nonce: &[u8], proof: &[u8]) -> bool {
        self.mac(CLIENT_CONTEXT, server_nonce, client_nonce).verify_slice(proof).is_ok()
    }

    /// Checks a server's proof in constant time.
    pub(crate) fn verify_server(&self, server_nonce: &[u8], client_nonce: &[u8], proof: &[u8]) -> bool {
        self.mac(SERVER_CONTEXT, server_nonce, client_nonce).verify_slice(proof).is_ok()
    }
}

/// A fresh random nonce.
pub(crate) fn nonce() -> [u8; NONCE_BYTES] {
    let mut nonce = [0u8; NONCE_BYTES];
    rand::rng().fill_bytes(&mut nonce);
    nonce
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proofs_depend_on_token_nonces_and_side() {
        let a = Token::from_bytes(*b"0123456789abcdef").unwrap();
        let b = Token::from_bytes(*b"0123456789abcdeF").unwrap();
        let (s, c) = (nonce(), nonce());
        let proof = a.client_proof(&s, &c);
        assert!(a.verify_client(&s, &c, &proof));
        assert!(!b.verify_client(&s, &c, &proof));
        assert!(!a.verify_client(&c, &s, &proof));
        assert!(!a.verify_server(&s, &c, &proof), "a client proof must not pass as a server proof");
        assert!(!a.verify_client(&s, &c, &proof[..31]));
        assert!(a.verify_server(&s, &c, &a.server_proof(&s, &c)));
    }

    #[test]
    fn debug_hides_the_bytes() {
        let token = Token::from_bytes(*b"secret-secret-secret").unwrap();
        assert_eq!(format!("{token:?}"), "Token(20 bytes)");
    }

    #[test]
    fn generated_tokens_differ_and_are_long_enough() {
        let (a, b) = (Token::generate(), Token::generate());
        assert_ne!(a, b);
        assert_eq!(a.as_bytes().len(), 64);
    }
}
