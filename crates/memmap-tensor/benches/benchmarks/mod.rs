pub(crate) mod gather;
