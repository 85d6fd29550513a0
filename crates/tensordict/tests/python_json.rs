//! Python's JSON in non-tensor values: bytes with `NaN`/`Infinity` tokens, big integers and
//! float literals anywhere never panic the reader, and what loads is written back unchanged.

use proptest::prelude::*;
use tensordict::TensorDict;

proptest! {
    /// Any bytes with NaN/Infinity tokens sprinkled in, as a non-tensor value's meta.json:
    /// loading never panics, and a value that loads is written back as it was read.
    #[test]
    fn non_finite_tokens_never_panic_and_round_trip(
        parts in proptest::collection::vec(
            prop_oneof![
                Just("NaN".to_owned()), Just("-Infinity".to_owned()), Just("Infinity".to_owned()),
                Just("[".to_owned()), Just("]".to_owned()), Just(",".to_owned()), Just("\"".to_owned()),
                Just("\\".to_owned()), Just("1e400".to_owned()), Just("123456789012345678901234".to_owned()),
                "[ -~]{0,3}",
            ],
            0..12,
        )
    ) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("td");
        let mut td = TensorDict::new([1]);
        td.set("v", serde_json::json!(0)).unwrap();
        td.memmap(&path).unwrap();
        let data = parts.concat();
        let meta = format!(r#"{{"_type": "<class 'tensordict.tensorclass.NonTensorData'>", "data": {data}, "_metadata": null, "_is_non_tensor": true}}"#);
        std::fs::write(path.join("v/meta.json"), &meta).unwrap();
        if let Ok(loaded) = TensorDict::load_memmap(&path, memmap_tensor::Access::ReadOnly) {
            let again = dir.path().join("again");
            loaded.memmap(&again).unwrap();
            let back = TensorDict::load_memmap(&again, memmap_tensor::Access::ReadOnly).unwrap();
            prop_assert_eq!(back.get_non_tensor("v").unwrap(), loaded.get_non_tensor("v").unwrap());
        }
    }
}
