//! Examples live in this package's `[[example]]` targets.
#![forbid(unsafe_code)]
