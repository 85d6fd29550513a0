//! Nested named tensors ("TensorDicts") stored in folders compatible with PyTorch's `tensordict`.
//!
//! This crate is not built yet; it exports nothing.
#![forbid(unsafe_code)]
