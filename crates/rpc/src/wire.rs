//! Data that crosses the wire besides references: batch indices ([`WireIndex`]) and small dicts
//! sent by value ([`InlineDict`]). Both are flat (no recursive types), so decoding a hostile
//! frame cannot recurse deeply, and both are checked when they are turned back into the
//! library's types.

use memmap_tensor::Tensor;
use serde::{Deserialize, Serialize};
use tensordict::{Error, Index, Result, Schema, TensorDict};

/// An index over batch dims, as [`Index`] but flat: a tuple of items (one item is a plain index).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireIndex(pub Vec<IndexItem>);

/// One item of a [`WireIndex`]: the non-tuple forms of [`Index`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum IndexItem {
    /// [`Index::Int`].
    Int(i64),
    /// [`Index::Slice`].
    Slice {
        /// First position.
        start: Option<i64>,
        /// One past the last position.
        stop: Option<i64>,
        /// Step, positive.
        step: i64,
    },
    /// [`Index::List`].
    List(Vec<i64>),
    /// [`Index::ListNd`].
    ListNd {
        /// Positions in C order.
        indices: Vec<i64>,
        /// Shape of the index array.
        shape: Vec<usize>,
    },
    /// [`Index::Mask`].
    Mask(Vec<bool>),
    /// [`Index::MaskNd`].
    MaskNd {
        /// One bool per element, C order.
        mask: Vec<bool>,
        /// The masked dims.
        shape: Vec<usize>,
    },
    /// [`Index::Ellipsis`].
    Ellipsis,
    /// [`Index::NewDim`].
    NewDim,
}

impl WireIndex {
    /// The wire form of `index`; an index of a kind the wire does not carry (a tuple inside a
    /// tuple) is an error.
    pub fn new(index: &Index) -> Result<WireIndex> {
        match index {
            Index::Tuple(items) => items.iter().map(IndexItem::new).collect::<Result<Vec<_>>>().map(WireIndex),
            single => Ok(WireIndex(vec![IndexItem::new(single)?])),
        }
    }

    /// The index; it is checked against the dict's batch size when it is applied.
    pub fn to_index(&self) -> Index {
        match self.0.as_slice() {
            [single] => single.to_index(),
            items => Index::Tuple(items.iter().map(IndexItem::to_index).collect()),
        }
    }
}

impl IndexItem {
    fn new(index: &Index) -> Result<IndexItem> {
        Ok(match index {
            Index::Int(i) => IndexItem::Int(*i),
            Index::Slice { start, stop, step } => IndexItem::Slice { start: *start, stop: *stop, step: *step },
            Index::List(v) => IndexItem::List(v.clone()),
            Index::ListNd { indices, shape } => IndexItem::ListNd { indices: indices.clone(), shape: shape.clone() },
            Index::Mask(m) => IndexItem::Mask(m.clone()),
            Index::MaskNd { mask, shape } => IndexItem::MaskNd { mask: mask.clone(), shape: shape.clone() },
            Index::Ellipsis => IndexItem::Ellipsis,
            Index::NewDim => IndexItem::NewDim,
            other => {
                return Err(Error::InvalidArgument {
                    op: "WireIndex::new",
                    detail: format!("the index {other} cannot be sent (a tuple inside a tuple)"),
                });
            }
        })
    }

    fn to_index(&self) -> Index {
        match self {
            IndexItem::Int(i) => Index::Int(*i),
            IndexItem::Slice { start, stop, step } => Index::Slice { start: *start, stop: *stop, step: *step },
            IndexItem::List(v) => Index::List(v.clone()),
            IndexItem::ListNd { indices, shape } => Index::ListNd { indices: indices.clone(), shape: shape.clone() },
            IndexItem::Mask(m) => Index::Mask(m.clone()),
            IndexItem::MaskNd { mask, shape } => Index::MaskNd { mask: mask.clone(), shape: shape.clone() },
            IndexItem::Ellipsis => Index::Ellipsis,
            IndexItem::NewDim => Index::NewDim,
        }
    }
}

/// A small dict sent by value: its schema and each tensor's bytes (C order, little-endian), for
/// batches too small to be worth a shared folder or shared memory.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct InlineDict {
    #[serde(with = "schema_json::owned")]
    schema: Schema,
    #[serde(with = "bytes_list")]
    data: Vec<Vec<u8>>,
}

impl InlineDict {
    /// The dict's schema and bytes.
    pub fn new(td: &TensorDict) -> Result<InlineDict> {
        let mut data = Vec::new();
        let schema = Schema::of(td, &mut |key, t| {
            data.push(t.to_bytes().map_err(|source| Error::Tensor { key: key.clone(), source })?);
            Ok((data.len() - 1).to_string())
        })?;
        Ok(InlineDict { schema, data })
    }

    /// Bytes of tensor data carried.
    pub fn nbytes(&self) -> usize {
        self.data.iter().map(Vec::len).sum()
    }

    /// The dict, on the heap; every tensor's byte count is checked against its shape.
    pub fn to_dict(&self) -> Result<TensorDict> {
        self.schema.validate()?;
        let tensors = self.schema.tensors();
        if tensors.len() != self.data.len() {
            return Err(Error::InvalidSchema {
                reason: format!("{} tensors but {} byte buffers", tensors.len(), self.data.len()),
            });
        }
        let mut next = self.data.iter();
        self.schema.build(&mut |key, t| {
            let bytes = next.next().map(Vec::as_slice).unwrap_or_default();
            // Checked before anything is allocated: the shape comes from the peer.
            let want =
                t.dtype.bytes_of(&t.shape).map_err(|e| Error::InvalidSchema { reason: format!("`{key}`: {e}") })?;
            if bytes.len() != want {
                return Err(Error::InvalidSchema {
                    reason: format!(
                        "`{key}`: {} bytes sent for a {} {:?} tensor ({want} bytes)",
                        bytes.len(),
                        t.dtype,
                        t.shape
                    ),
                });
            }
            Tensor::from_bytes(bytes, t.dtype, t.shape.as_slice())
                .map_err(|source| Error::Tensor { key: key.clone(), source })
        })
    }
}

/// A schema as its JSON text: bincode cannot carry JSON values, and text is parsed with a
/// bounded depth ([`Schema::from_json`]), so a hostile frame cannot exhaust the stack.
pub(crate) mod schema_json {
    use std::collections::VecDeque;
    use std::sync::{Arc, Mutex, PoisonError};

    use serde::{Deserializer, Serializer};
    use tensordict::Schema;

    /// Schemas sent or received lately, with their exact text: the same dict's references cross
    /// the wire again and again (every call of a worker or store), and encoding, decoding,
    /// checking and copying one costs more than the rest of a round trip. A reference decoded
    /// from a known text shares the schema kept here, so a reference sent back (or on) is found
    /// by pointer, without comparing schemas. Only schemas that passed every check (or were
    /// made here) are kept; entries are bounded in number and size.
    static DECODED: Mutex<VecDeque<(Box<str>, Arc<Schema>)>> = Mutex::new(VecDeque::new());
    const CACHED_SCHEMAS: usize = 64;
    const MAX_CACHED_TEXT: usize = 16 << 10;

    pub(crate) fn serialize<S: Serializer>(schema: &Arc<Schema>, s: S) -> Result<S::Ok, S::Error> {
        encode(schema, Some(schema), s)
    }

    /// Writes `schema`'s text: a schema that came in (or went out) lately has it at hand, found
    /// by pointer when `shared` is the one kept (a reference passed on), else by value.
    fn encode<S: Serializer>(schema: &Schema, shared: Option<&Arc<Schema>>, s: S) -> Result<S::Ok, S::Error> {
        {
            let cache = cache();
            let known = shared.and_then(|shared| cache.iter().find(|(_, known)| Arc::ptr_eq(known, shared)));
            if let Some((text, _)) = known.or_else(|| cache.iter().find(|(_, known)| **known == *schema)) {
                return s.serialize_str(text);
            }
        }
        let json = schema.to_json();
        let text = std::str::from_utf8(&json).map_err(serde::ser::Error::custom)?;
        remember(text, &shared.map_or_else(|| Arc::new(schema.clone()), Arc::clone));
        s.serialize_str(text)
    }

    fn cache() -> std::sync::MutexGuard<'static, VecDeque<(Box<str>, Arc<Schema>)>> {
        DECODED.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn remember(text: &str, schema: &Arc<Schema>) {
        if text.len() <= MAX_CACHED_TEXT {
            let mut cache = cache();
            if cache.len() >= CACHED_SCHEMAS {
                cache.pop_front();
            }
            cache.push_back((text.into(), Arc::clone(schema)));
        }
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Arc<Schema>, D::Error> {
        // The text is looked at where the decoder holds it, not copied into a `String` first.
        struct Text;
        impl serde::de::Visitor<'_> for Text {
            type Value = Arc<Schema>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a schema as JSON text")
            }
            fn visit_str<E: serde::de::Error>(self, text: &str) -> Result<Arc<Schema>, E> {
                decode(text).map_err(E::custom)
            }
        }
        d.deserialize_str(Text)
    }

    fn decode(text: &str) -> tensordict::Result<Arc<Schema>> {
        if let Some((_, schema)) = cache().iter().find(|(known, _)| **known == *text) {
            return Ok(Arc::clone(schema));
        }
        let schema = Arc::new(Schema::from_json(text.as_bytes())?);
        remember(text, &schema);
        Ok(schema)
    }

    /// The same encoding for a schema held by value (a dict sent by value, an entry's layout).
    pub(crate) mod owned {
        use std::sync::Arc;

        use serde::{Deserializer, Serializer};
        use tensordict::Schema;

        pub(crate) fn serialize<S: Serializer>(schema: &Schema, s: S) -> Result<S::Ok, S::Error> {
            super::encode(schema, None, s)
        }

        pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Schema, D::Error> {
            super::deserialize(d).map(Arc::unwrap_or_clone)
        }
    }
}

/// Byte buffers as byte strings (one length and a copy each), not as sequences of numbers.
mod bytes_list {
    use serde::de::{SeqAccess, Visitor};
    use serde::ser::SerializeSeq;
    use serde::{Deserializer, Serializer};

    struct Bytes<'a>(&'a [u8]);

    impl serde::Serialize for Bytes<'_> {
        fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            s.serialize_bytes(self.0)
        }
    }

    pub(super) struct ByteBuf(pub(super) Vec<u8>);

    impl<'de> serde::Deserialize<'de> for ByteBuf {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct V;
            impl<'de> Visitor<'de> for V {
                type Value = ByteBuf;
                fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                    f.write_str("bytes")
                }
                fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> Result<ByteBuf, E> {
                    Ok(ByteBuf(v.to_vec()))
                }
                fn visit_byte_buf<E: serde::de::Error>(self, v: Vec<u8>) -> Result<ByteBuf, E> {
                    Ok(ByteBuf(v))
                }
                fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<ByteBuf, A::Error> {
                    let mut out = Vec::new();
                    while let Some(b) = seq.next_element::<u8>()? {
                        out.push(b);
                    }
                    Ok(ByteBuf(out))
                }
            }
            d.deserialize_byte_buf(V)
        }
    }

    pub(super) fn serialize<S: Serializer>(data: &[Vec<u8>], s: S) -> Result<S::Ok, S::Error> {
        let mut seq = s.serialize_seq(Some(data.len()))?;
        for buf in data {
            seq.serialize_element(&Bytes(buf))?;
        }
        seq.end()
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Vec<u8>>, D::Error> {
        let bufs: Vec<ByteBuf> = serde::Deserialize::deserialize(d)?;
        Ok(bufs.into_iter().map(|b| b.0).collect())
    }
}

/// One byte buffer as a byte string (a length and a copy), not as a sequence of numbers.
#[cfg(feature = "store")]
pub(crate) mod byte_string {
    use serde::{Deserializer, Serializer};

    pub(crate) fn serialize<S: Serializer>(data: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(data)
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let buf: super::bytes_list::ByteBuf = serde::Deserialize::deserialize(d)?;
        Ok(buf.0)
    }
}

#[cfg(test)]
mod tests {
    use memmap_tensor::{DType, Location};

    use super::*;

    #[test]
    fn indices_cross_the_wire_whole() {
        let indices = [
            Index::Int(-1),
            Index::slice(Some(1), None, 2),
            Index::List(vec![4, 5, 998]),
            Index::Tuple(vec![Index::Mask(vec![true, false]), Index::Ellipsis, Index::NewDim]),
        ];
        for index in indices {
            let wire = WireIndex::new(&index).expect("sendable");
            let json = serde_json::to_string(&wire).expect("serializes");
            let back: WireIndex = serde_json::from_str(&json).expect("deserializes");
            assert_eq!(back.to_index(), index);
        }
        assert!(WireIndex::new(&Index::Tuple(vec![Index::Tuple(vec![])])).is_err());
    }

    #[test]
    fn inline_dicts_round_trip_and_check_their_bytes() {
        let mut td = TensorDict::new([2]);
        td.set("obs", Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0], [2, 2]).unwrap()).unwrap();
        td.set(["next", "done"], Tensor::zeros([2], DType::Bool, &Location::Heap).unwrap()).unwrap();
        let inline = InlineDict::new(&td).unwrap();
        assert_eq!(inline.nbytes(), 18);
        let json = serde_json::to_string(&inline).unwrap();
        let back: InlineDict = serde_json::from_str(&json).unwrap();
        let dict = back.to_dict().unwrap();
        assert_eq!(dict.get_tensor("obs").unwrap().to_vec::<f32>().unwrap(), [1.0, 2.0, 3.0, 4.0]);

        let mut short = back.clone();
        short.data[0].pop();
        assert!(short.to_dict().is_err());
        let mut missing = back;
        missing.data.pop();
        assert!(missing.to_dict().is_err());
    }

    /// A schema decoded from a known text is the one kept (no copy), is sent back by pointer as
    /// the same text, and an equal schema made anew encodes to that text too: the bytes on the
    /// wire do not depend on the cache.
    #[test]
    fn schemas_decoded_again_are_shared_and_encode_to_the_same_text() {
        #[derive(serde::Serialize, serde::Deserialize)]
        struct Carried(#[serde(with = "schema_json")] std::sync::Arc<tensordict::Schema>);

        let mut td = TensorDict::new([3]);
        td.set("obs", Tensor::zeros([3, 7], DType::F32, &Location::Heap).unwrap()).unwrap();
        td.set(["next", "unique_key_of_this_test"], Tensor::zeros([3], DType::I64, &Location::Heap).unwrap()).unwrap();
        let schema = tensordict::Schema::of(&td, &mut |_, _| Ok(String::new())).unwrap();
        let fresh = bincode::serialize(&Carried(std::sync::Arc::new(schema.clone()))).unwrap();
        let first: Carried = bincode::deserialize(&fresh).unwrap();
        let second: Carried = bincode::deserialize(&fresh).unwrap();
        assert!(std::sync::Arc::ptr_eq(&first.0, &second.0), "a known text decodes to the schema kept");
        assert_eq!(*first.0, schema);
        assert_eq!(bincode::serialize(&second).unwrap(), fresh);
        assert_eq!(bincode::serialize(&Carried(std::sync::Arc::new(schema))).unwrap(), fresh);
        // Text that is not a schema is an error, known or not.
        let mut hostile = fresh.clone();
        let at = hostile.len() - 2;
        hostile[at] = b'{';
        assert!(bincode::deserialize::<Carried>(&hostile).is_err());
    }
}
