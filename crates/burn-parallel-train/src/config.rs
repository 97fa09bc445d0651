//! [`from_toml`]: a settings struct from TOML, with an unknown key answered by the nearest
//! known one (`stpes = 10`: "did you mean `steps`?").

use serde::de::DeserializeOwned;

/// `T` from the TOML `text`; an unknown key (with `#[serde(deny_unknown_fields)]`) is refused
/// naming the nearest known key when one is close.
///
/// # Errors
/// The TOML error, with its position and the suggestion.
///
/// # Example
/// ```
/// use burn_parallel_train::{Layout, from_toml};
///
/// let err = from_toml::<Layout>("zeor = 2").unwrap_err();
/// assert!(err.contains("did you mean `zero`?"), "{err}");
/// assert_eq!(from_toml::<Layout>("tp = 2").unwrap().tp, 2);
/// ```
pub fn from_toml<T: DeserializeOwned>(text: &str) -> Result<T, String> {
    toml::from_str(text).map_err(|e| with_suggestion(e.message(), &e.to_string()))
}

/// `message` (a deserialiser's, `full` with its position) with the nearest expected field
/// named when it is an unknown-field error and one field is close to the unknown one.
fn with_suggestion(message: &str, full: &str) -> String {
    let names = |text: &str| -> Vec<String> {
        text.split('`')
            .skip(1)
            .step_by(2)
            .map(str::to_owned)
            .collect()
    };
    let Some(rest) = message.strip_prefix("unknown field ") else {
        return full.to_owned();
    };
    let (unknown, expected) = match rest.split_once(", expected") {
        Some((unknown, expected)) => (names(unknown), names(expected)),
        None => return full.to_owned(),
    };
    let Some(unknown) = unknown.first() else {
        return full.to_owned();
    };
    let nearest = expected
        .iter()
        .map(|known| (edit_distance(unknown, known), known))
        .min();
    match nearest {
        // Close: at most a third of the key's letters differ.
        Some((d, known)) if d * 3 <= unknown.len().max(known.len()) => {
            format!("{full}\ndid you mean `{known}`?")
        }
        _ => full.to_owned(),
    }
}

/// Edit distance between `a` and `b` (by chars): insertions, deletions, substitutions and
/// swaps of two neighbours (the optimal string alignment distance), each counting 1.
fn edit_distance(a: &str, b: &str) -> usize {
    let (a, b): (Vec<char>, Vec<char>) = (a.chars().collect(), b.chars().collect());
    let mut d = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for (i, row) in d.iter_mut().enumerate() {
        row[0] = i;
    }
    for (j, cell) in d[0].iter_mut().enumerate() {
        *cell = j;
    }
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            let mut best = (d[i - 1][j] + 1)
                .min(d[i][j - 1] + 1)
                .min(d[i - 1][j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                best = best.min(d[i - 2][j - 2] + 1);
            }
            d[i][j] = best;
        }
    }
    d[a.len()][b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn edit_distance_counts_edits() {
        assert_eq!(edit_distance("stpes", "steps"), 1);
        assert_eq!(edit_distance("kitten", "sitting"), 3);
        assert_eq!(edit_distance("", "lr"), 2);
        assert_eq!(edit_distance("n_head", "n_heads"), 1);
    }
}
