//! [`Shape`]: the dimensions of a tensor.

use std::fmt;

/// The dimensions of a tensor, outermost first. A `Shape` on its own is unchecked: its element
/// count may overflow. A [`Layout`](crate::Layout) built from it checks all size arithmetic.
#[derive(Clone, PartialEq, Eq, Hash, Default)]
pub struct Shape(Vec<usize>);

impl Shape {
    /// A shape with the given dimensions.
    pub fn new(dims: impl Into<Vec<usize>>) -> Self {
        Shape(dims.into())
    }

    /// The shape of a scalar: no dimensions, one element.
    pub fn scalar() -> Self {
        Shape(Vec::new())
    }

    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.0.len()
    }

    /// The dimensions, outermost first.
    pub fn dims(&self) -> &[usize] {
        &self.0
    }

    /// The dimensions as an owned vector.
    pub fn into_dims(self) -> Vec<usize> {
        self.0
    }

    /// Product of the dimensions, or `None` if it overflows `usize`.
    pub fn elem_count_checked(&self) -> Option<usize> {
        self.0.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d))
    }

    /// Size of dimension `dim`, if it exists.
    pub fn dim(&self, dim: usize) -> Option<usize> {
        self.0.get(dim).copied()
    }
}

impl fmt::Debug for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// Prints `[2, 3, 4]`.
impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.0)
    }
}

impl From<Vec<usize>> for Shape {
    fn from(dims: Vec<usize>) -> Self {
        Shape(dims)
    }
}

impl From<&[usize]> for Shape {
    fn from(dims: &[usize]) -> Self {
        Shape(dims.to_vec())
    }
}

impl<const N: usize> From<[usize; N]> for Shape {
    fn from(dims: [usize; N]) -> Self {
        Shape(dims.to_vec())
    }
}

impl<const N: usize> From<&[usize; N]> for Shape {
    fn from(dims: &[usize; N]) -> Self {
        Shape(dims.to_vec())
    }
}

impl From<&Shape> for Shape {
    fn from(shape: &Shape) -> Self {
        shape.clone()
    }
}

impl From<()> for Shape {
    fn from((): ()) -> Self {
        Shape::scalar()
    }
}

impl From<usize> for Shape {
    fn from(d0: usize) -> Self {
        Shape(vec![d0])
    }
}

impl From<(usize,)> for Shape {
    fn from((d0,): (usize,)) -> Self {
        Shape(vec![d0])
    }
}

impl From<(usize, usize)> for Shape {
    fn from((d0, d1): (usize, usize)) -> Self {
        Shape(vec![d0, d1])
    }
}

impl From<(usize, usize, usize)> for Shape {
    fn from((d0, d1, d2): (usize, usize, usize)) -> Self {
        Shape(vec![d0, d1, d2])
    }
}

impl From<(usize, usize, usize, usize)> for Shape {
    fn from((d0, d1, d2, d3): (usize, usize, usize, usize)) -> Self {
        Shape(vec![d0, d1, d2, d3])
    }
}

impl PartialEq<[usize]> for Shape {
    fn eq(&self, other: &[usize]) -> bool {
        self.0 == other
    }
}

impl<const N: usize> PartialEq<[usize; N]> for Shape {
    fn eq(&self, other: &[usize; N]) -> bool {
        self.0 == other
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conversions_and_counts() {
        assert_eq!(Shape::from((2, 3)).dims(), &[2, 3]);
        assert_eq!(Shape::from([4, 5, 6]).elem_count_checked(), Some(120));
        assert_eq!(Shape::scalar().elem_count_checked(), Some(1));
        assert_eq!(Shape::from([2, 0, 7]).elem_count_checked(), Some(0));
        assert_eq!(Shape::from([2, 1 << 63]).elem_count_checked(), None);
        assert_eq!(Shape::from([2, 3]).to_string(), "[2, 3]");
    }
}
