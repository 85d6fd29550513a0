//! Heap tensors as I/O buffers: [`TensorBuf`] lends a tensor's bytes to the `aio` engine, so a
//! tensor is offloaded from, and read back into, its own memory.

use std::sync::Arc;

use tensordict_aio::{IoBuf, IoBufMut};

use crate::{Error, Result, StorageKind, Tensor};

/// A contiguous heap tensor that is the only handle on its storage, usable as an
/// [`tensordict_aio::IoBuf`] / [`tensordict_aio::IoBufMut`]. Get the tensor back with [`TensorBuf::into_tensor`].
pub struct TensorBuf {
    tensor: Tensor,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the pointer is into the heap or pinned storage owned (exclusively, see `Tensor::into_io_buf`)
// by the tensor held alongside it.
unsafe impl Send for TensorBuf {}

impl Tensor {
    /// This tensor as an I/O buffer. It must be contiguous, live on the heap (or in pinned
    /// memory, which the GPU offload uses), and be the only
    /// handle on its storage (no clone or view of it alive), because the engine reads or writes
    /// its bytes while nothing else may.
    pub fn into_io_buf(self) -> Result<TensorBuf> {
        const OP: &str = "into_io_buf";
        if !matches!(self.storage().kind(), StorageKind::Heap | StorageKind::Pinned) {
            return Err(Error::NotExclusive { op: OP, reason: "only heap and pinned tensors can be I/O buffers" });
        }
        if !self.is_contiguous() {
            return Err(Error::NotContiguous {
                op: OP,
                shape: self.shape().clone(),
                strides: self.layout().strides().to_vec(),
            });
        }
        if Arc::strong_count(self.storage()) != 1 || Arc::weak_count(self.storage()) != 0 {
            return Err(Error::NotExclusive { op: OP, reason: "another handle shares the storage" });
        }
        let ptr = self.storage().base_ptr().wrapping_add(self.byte_span().start);
        let len = self.nbytes();
        Ok(TensorBuf { tensor: self, ptr, len })
    }
}

impl TensorBuf {
    /// The tensor back.
    pub fn into_tensor(self) -> Tensor {
        self.tensor
    }

    /// The tensor's bytes, to fill in place (rows copied straight into a new tensor).
    pub fn as_mut_bytes(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` points to the tensor's `len` initialised bytes of heap or pinned storage that
        // this value holds the only handle on (see the `IoBuf` impl), and the borrow of `self`
        // keeps any other access away for the slice's lifetime.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

// SAFETY: `ptr` points to the tensor's `len` bytes inside a heap or pinned allocation owned by the
// storage, which this value holds the only handle on (checked in `into_io_buf`; `TensorBuf`
// gives out no other handle), so the memory stays put when the value moves and nothing else
// touches it. Heap and pinned storage are always initialised (zeroed, or written in full before use).
unsafe impl IoBuf for TensorBuf {
    fn stable_ptr(&self) -> *const u8 {
        self.ptr
    }
    fn bytes_init(&self) -> usize {
        self.len
    }
    fn bytes_total(&self) -> usize {
        self.len
    }
}

// SAFETY: as above; heap and pinned storage are writable and every byte stays initialised.
unsafe impl IoBufMut for TensorBuf {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.ptr
    }
    unsafe fn set_init(&mut self, _n: usize) {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{DType, Location};

    #[test]
    fn only_exclusive_contiguous_heap_tensors_lend_their_bytes() {
        let t = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0], [2, 2]).unwrap();
        let view = t.narrow(0, 1, 1).unwrap();
        assert!(matches!(t.clone().into_io_buf(), Err(Error::NotExclusive { .. })));
        drop(view);
        let buf = t.into_io_buf().unwrap();
        assert_eq!(buf.bytes_init(), 16);
        let back = buf.into_tensor();
        assert_eq!(back.to_vec::<f32>().unwrap(), [1.0, 2.0, 3.0, 4.0]);
        let strided = Tensor::zeros([4, 4], DType::U8, &Location::Heap).unwrap().slice(1, 0, 4, 2).unwrap();
        assert!(matches!(strided.into_io_buf(), Err(Error::NotContiguous { .. })));
    }

    #[test]
    fn bytes_filled_in_place_are_the_tensors() {
        let mut buf = Tensor::zeros([2, 3], DType::U16, &Location::Heap).unwrap().into_io_buf().unwrap();
        let bytes = buf.as_mut_bytes();
        assert_eq!(bytes.len(), 12);
        for (pair, value) in bytes.chunks_exact_mut(2).zip((0u16..).step_by(7)) {
            pair.copy_from_slice(&value.to_le_bytes());
        }
        assert_eq!(buf.into_tensor().to_vec::<u16>().unwrap(), [0, 7, 14, 21, 28, 35]);
    }
}
