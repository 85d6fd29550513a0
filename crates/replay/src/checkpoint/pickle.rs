//! `prefetch.pkl`: the one pickle a dump holds, Python's `pickle.dumps` (protocol 4) of an
//! empty prefetch queue's state, written and read byte for byte as Python writes it, without a
//! pickle machine (any other pickle is refused).

/// `prefetch.pkl`: the prefetch queue's capacity (the queue itself must be empty).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Prefetch {
    /// The prefetch capacity the buffer was built with (TorchRL checks it on load).
    pub capacity: u32,
}

/// Python's pickle (protocol 4) of `{"version": 1, "capacity": <int>, "queue": ()}` is
/// `PICKLE_HEAD`, the frame length (u64 LE), `PICKLE_DICT_HEAD`, the integer opcode,
/// `PICKLE_TAIL`.
const PICKLE_HEAD: &[u8] = b"\x80\x04\x95";
const PICKLE_DICT_HEAD: &[u8] = b"}\x94(\x8c\x07version\x94K\x01\x8c\x08capacity\x94";
const PICKLE_TAIL: &[u8] = b"\x8c\x05queue\x94)u.";

impl Prefetch {
    /// The bytes Python's `pickle.dump` writes for this state.
    pub fn to_pickle(&self) -> Vec<u8> {
        let int: Vec<u8> = match self.capacity {
            c if c < 0x100 => vec![b'K', c as u8],
            c if c < 0x1_0000 => {
                let mut v = vec![b'M'];
                v.extend_from_slice(&(c as u16).to_le_bytes());
                v
            }
            c => {
                let mut v = vec![b'J'];
                v.extend_from_slice(&c.to_le_bytes());
                v
            }
        };
        let body_len = PICKLE_DICT_HEAD.len() + int.len() + PICKLE_TAIL.len();
        let mut out = Vec::with_capacity(PICKLE_HEAD.len() + 8 + body_len);
        out.extend_from_slice(PICKLE_HEAD);
        out.extend_from_slice(&(body_len as u64).to_le_bytes());
        out.extend_from_slice(PICKLE_DICT_HEAD);
        out.extend_from_slice(&int);
        out.extend_from_slice(PICKLE_TAIL);
        out
    }

    /// Reads the pickle of an empty prefetch state; anything else (a non-empty queue, another
    /// version, another pickler's output) is `None`.
    pub fn from_pickle(bytes: &[u8]) -> Option<Prefetch> {
        let rest = bytes.strip_prefix(PICKLE_HEAD)?;
        let (frame, rest) = rest.split_at_checked(8)?;
        let frame = u64::from_le_bytes(frame.try_into().ok()?);
        if u64::try_from(rest.len()).ok()? != frame {
            return None;
        }
        let rest = rest.strip_prefix(PICKLE_DICT_HEAD)?;
        let (capacity, rest) = match rest.split_first()? {
            (b'K', r) => (u32::from(*r.first()?), r.get(1..)?),
            (b'M', r) => (u32::from(u16::from_le_bytes(r.get(..2)?.try_into().ok()?)), r.get(2..)?),
            (b'J', r) => (u32::try_from(i32::from_le_bytes(r.get(..4)?.try_into().ok()?)).ok()?, r.get(4..)?),
            _ => return None,
        };
        let prefetch = Prefetch { capacity };
        // Python picks the shortest opcode; another spelling is not what it writes.
        (rest == PICKLE_TAIL && prefetch.to_pickle() == bytes).then_some(prefetch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefetch_pickle_matches_python_for_each_int_opcode() {
        // Bytes from Python 3.11's pickle.dumps({"version": 1, "capacity": c, "queue": ()}).
        let cases: [(u32, &str); 3] = [
            (0, "80049527000000000000007d94288c0776657273696f6e944b018c086361706163697479944b008c0571756575659429752e"),
            (
                300,
                "80049528000000000000007d94288c0776657273696f6e944b018c086361706163697479944d2c018c0571756575659429752e",
            ),
            (
                70000,
                "8004952a000000000000007d94288c0776657273696f6e944b018c086361706163697479944a701101008c0571756575659429752e",
            ),
        ];
        for (capacity, hex) in cases {
            let bytes: Vec<u8> =
                (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap()).collect();
            assert_eq!(Prefetch { capacity }.to_pickle(), bytes, "capacity {capacity}");
            assert_eq!(Prefetch::from_pickle(&bytes), Some(Prefetch { capacity }));
            let mut truncated = bytes.clone();
            truncated.pop();
            assert_eq!(Prefetch::from_pickle(&truncated), None);
        }
    }
}
