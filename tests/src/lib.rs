//! Integration tests that span crates or need real processes. The `tensor-peer` binary is the
//! second process of the multi-process tests.
#![forbid(unsafe_code)]
