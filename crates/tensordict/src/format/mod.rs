//! Memmap folders in the layout of Python tensordict's `memmap` (see `FORMAT.md`): the writer
//! ([`TensorDict::memmap`], [`TensorDict::memmap_like`], in `write.rs`) and the reader
//! ([`TensorDict::load_memmap`], and the folder walk that [`TensorDict::read_memmap`] shares, in
//! `load.rs`).

pub(crate) mod consolidated;
mod load;
mod torch_save;
mod write;

pub(crate) use load::{LeafFile, Leaves, check_map_room, load_folder, read_lazy_tree, read_tree};
use load::{REMEDY_WRITE, map_tree, repeat_first_row};
pub(crate) use write::Writing;
pub use write::{WRITE_PIECE, WriteOptions};

/// `_type` of a TensorDict node in `meta.json`.
pub(crate) const TD_TYPE: &str = "<class 'tensordict._td.TensorDict'>";
/// `_class` of a TensorDict node (format version 1).
pub(crate) const TD_CLASS: &str = "tensordict:TensorDict";
/// `_type` of a lazy stack's `meta.json`.
pub(crate) const LAZY_TYPE: &str = "<class 'tensordict._lazy.LazyStackedTensorDict'>";
/// `_class` of a lazy stack (format version 1).
pub(crate) const LAZY_CLASS: &str = "tensordict:LazyStackedTensorDict";
/// The folder of a tensorclass that holds its fields, as a dict.
pub(crate) const CLASS_FIELDS_DIR: &str = "_tensordict";
/// The file of a tensorclass's pickled fields, and the file of their types beside it.
pub(crate) const CLASS_PICKLE_FILES: [&str; 2] = ["other.pickle", "json_types.json"];
/// `_type` of a non-tensor value's `meta.json`.
pub(crate) const NON_TENSOR_TYPE: &str = "<class 'tensordict.tensorclass.NonTensorData'>";
/// `_type` of a non-tensor stack's `meta.json`.
pub(crate) const NON_TENSOR_STACK_TYPE: &str = "<class 'tensordict.tensorclass.NonTensorStack'>";
/// The newest format version this crate reads and the one it writes.
pub const FORMAT_VERSION: i64 = 1;
/// `meta.json` files larger than this are refused before they are read.
pub const MAX_META_BYTES: u64 = 64 << 20;
/// The deepest a dict may nest: a dict, in memory or as a folder, holds dicts at most this many
/// levels below it, and setting an entry that would go deeper is [`crate::Error::TooDeep`].
///
/// Every walk down a dict (load, write, repr, clone, index, drop) recurses once per level, so
/// a bound keeps a hostile folder or a self-referencing Python dict from exhausting the stack;
/// 128 keeps the deepest walk far inside the smallest stack it runs on (a 2 MiB thread). It is
/// one limit for memory and folders alike, so whatever is made can be written and whatever a
/// folder holds loads. Real dicts nest a handful of levels (TorchRL's deepest keys, such as
/// `("next", "agents", "observation")`, are three; a model's state dict, flattened to dotted
/// names, none).
pub const MAX_DEPTH: usize = 128;
