//! [`TensorClass`]: the Python class a dict stands for, when it was a tensorclass.

use serde_json::{Map, Value};

use crate::{Error, Result, Unreadable};

/// The Python class of a dict that was a tensorclass (`@tensorclass class Point: ...`): its
/// folder holds the fields in `_tensordict/` and names the class in its own `meta.json`.
///
/// A dict loaded from such a folder remembers its class ([`crate::TensorDict::class`]), keeps
/// it through indexing, gathers, clones and moves, and is written back under the same class,
/// so that Python's `load_memmap` gives the tensorclass again. From Python, `to_tensordict`
/// returns an instance of the class where its module can be imported.
///
/// ```
/// use tensordict::TensorClass;
///
/// let class = TensorClass::new("agents.Observation")?;
/// assert_eq!(class.name(), "Observation");
/// assert_eq!(class.module(), "agents");
/// assert_eq!(class.python_type(), "<class 'agents.Observation'>");
/// # Ok::<(), tensordict::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct TensorClass {
    path: String,
    fields: Map<String, Value>,
    /// The fields Python pickled (`other.pickle` and its types file), copied as they are.
    pickled: Option<Box<Unreadable>>,
}

impl TensorClass {
    /// The class at `path`, its module and name joined by dots (`"mod.sub.Name"`), as Python's
    /// `f"{cls.__module__}.{cls.__qualname__}"`.
    pub fn new(path: impl Into<String>) -> Result<TensorClass> {
        let path = path.into();
        let valid_part = |part: &str| {
            part.chars().next().is_some_and(|c| c.is_alphabetic() || c == '_')
                && part.chars().all(|c| c.is_alphanumeric() || c == '_')
        };
        if !path.contains('.') || !path.split('.').all(valid_part) {
            return Err(Error::InvalidArgument {
                op: "TensorClass::new",
                detail: format!("`{path}` is not a Python class path such as `module.Name`"),
            });
        }
        Ok(TensorClass { path, fields: Map::new(), pickled: None })
    }

    /// The class named by a folder's `_type` (`"<class 'mod.Name'>"`), or `None` if it names
    /// no class path.
    pub(crate) fn from_python_type(python_type: &str) -> Option<TensorClass> {
        let path = python_type.strip_prefix("<class '")?.strip_suffix("'>")?;
        TensorClass::new(path).ok()
    }

    /// Module and name joined by dots: `"mod.Name"`.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The class name, the last part of [`TensorClass::path`].
    pub fn name(&self) -> &str {
        self.path.rsplit('.').next().unwrap_or(&self.path)
    }

    /// The module, everything before the last dot of [`TensorClass::path`].
    pub fn module(&self) -> &str {
        self.path.rsplit_once('.').map_or("", |(module, _)| module)
    }

    /// `"<class 'mod.Name'>"`: how Python's folders name the class (`meta.json`'s `_type`).
    pub fn python_type(&self) -> String {
        format!("<class '{}'>", self.path)
    }

    /// The fields that are neither tensors nor dicts and that Python stored as JSON beside the
    /// class name (most non-tensor fields live in the dict, as non-tensor entries).
    pub fn fields(&self) -> &Map<String, Value> {
        &self.fields
    }

    /// Sets a JSON field kept beside the class name.
    pub fn set_field(&mut self, name: impl Into<String>, value: Value) {
        self.fields.insert(name.into(), value);
    }

    /// The fields Python pickled beside the class name, if any: kept, and copied as they are.
    pub fn pickled(&self) -> Option<&Unreadable> {
        self.pickled.as_deref()
    }

    pub(crate) fn with_fields(mut self, fields: Map<String, Value>, pickled: Option<Unreadable>) -> TensorClass {
        self.fields = fields;
        self.pickled = pickled.map(Box::new);
        self
    }
}
