//! Asynchronous disk I/O for tensor data: an io_uring engine with a thread-pool fallback.
//!
//! This crate is not built yet; it exports nothing.
