//! References to TensorDicts passed between processes and nodes over tarpc.
//!
//! This crate is not built yet; it exports nothing.
#![forbid(unsafe_code)]
