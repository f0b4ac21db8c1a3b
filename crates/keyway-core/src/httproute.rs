//! HTTPRoute as keyway reads it: the standard channel's type plus each rule's `retry`.
//!
//! `rules[].retry` is in Gateway API's standard channel since v1.7 (GEP-1731), but the
//! standard types of gateway-api 0.22 predate it; the experimental channel's type for it is
//! the same schema. So a rule's `retry` is read with that type beside the standard route,
//! and written back in its place, so `status -o yaml` echoes the route as written.

use std::ops::{Deref, DerefMut};

use gateway_api::apis::experimental::httproutes::HttpRouteRulesRetry;
use gateway_api::apis::standard::httproutes::HttpRoute;
use serde_json::Value;

use crate::resource::{PathError, typed};

/// An HTTPRoute: the upstream standard object (`Deref`s to it) and, by rule index, each
/// rule's `retry`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct HTTPRoute {
    pub route: HttpRoute,
    /// `spec.rules[i].retry`, one entry per rule (`None`: the rule has none).
    pub retries: Vec<Option<HttpRouteRulesRetry>>,
}

impl HTTPRoute {
    /// The retry policy of rule `i`, if it has one.
    pub fn retry(&self, i: usize) -> Option<&HttpRouteRulesRetry> {
        self.retries.get(i).and_then(Option::as_ref)
    }

    /// Converts a document, as [`typed`] does, with the errors and unknown fields of a rule's
    /// `retry` reported at their own paths (`spec.rules[1].retry.codes[0]`).
    pub(crate) fn from_value(mut value: Value) -> Result<(HTTPRoute, Vec<String>), PathError> {
        let taken: Vec<Option<Value>> = match value.pointer_mut("/spec/rules") {
            Some(Value::Array(rules)) => rules
                .iter_mut()
                .map(|rule| rule.as_object_mut().and_then(|r| r.remove("retry")))
                .collect(),
            _ => Vec::new(),
        };
        let (route, mut ignored) = typed::<HttpRoute>(value)?;
        let mut retries = Vec::with_capacity(taken.len());
        for (i, retry) in taken.into_iter().enumerate() {
            let at = format!("spec.rules[{i}].retry");
            let Some(retry) = retry.filter(|r| !r.is_null()) else {
                retries.push(None);
                continue;
            };
            let within = |p: &str| {
                if p.is_empty() {
                    at.clone()
                } else {
                    format!("{at}.{p}")
                }
            };
            match typed::<HttpRouteRulesRetry>(retry) {
                Ok((r, unknown)) => {
                    ignored.extend(unknown.iter().map(|p| within(p)));
                    retries.push(Some(r));
                }
                Err(e) => {
                    ignored.extend(e.ignored.iter().map(|p| within(p)));
                    return Err(PathError {
                        path: within(&e.path),
                        message: e.message,
                        ignored,
                        also: e.also.into_iter().map(|(p, m)| (within(&p), m)).collect(),
                    });
                }
            }
        }
        Ok((HTTPRoute { route, retries }, ignored))
    }
}

impl Deref for HTTPRoute {
    type Target = HttpRoute;
    fn deref(&self) -> &HttpRoute {
        &self.route
    }
}

impl DerefMut for HTTPRoute {
    fn deref_mut(&mut self) -> &mut HttpRoute {
        &mut self.route
    }
}

impl serde::Serialize for HTTPRoute {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut v = serde_json::to_value(&self.route).map_err(serde::ser::Error::custom)?;
        if let Some(Value::Array(rules)) = v.pointer_mut("/spec/rules") {
            for (rule, retry) in rules.iter_mut().zip(&self.retries) {
                if let (Value::Object(rule), Some(retry)) = (rule, retry) {
                    let retry = serde_json::to_value(retry).map_err(serde::ser::Error::custom)?;
                    rule.insert("retry".into(), retry);
                }
            }
        }
        v.serialize(s)
    }
}

impl<'de> serde::Deserialize<'de> for HTTPRoute {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let value = Value::deserialize(d)?;
        HTTPRoute::from_value(value)
            .map(|(route, _)| route)
            .map_err(|e| serde::de::Error::custom(format!("{}: {}", e.path, e.message)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn route(rules: Value) -> Value {
        serde_json::json!({
            "apiVersion": "gateway.networking.k8s.io/v1",
            "kind": "HTTPRoute",
            "metadata": {"name": "r", "namespace": "default"},
            "spec": {"rules": rules},
        })
    }

    #[test]
    fn retry_is_read_per_rule_and_written_back_in_place() {
        let v = route(serde_json::json!([
            {"backendRefs": [{"name": "a", "port": 80}]},
            {"retry": {"codes": [503], "attempts": 2, "backoff": "100ms"}},
        ]));
        let (r, ignored) = HTTPRoute::from_value(v.clone()).unwrap();
        assert_eq!(
            ignored,
            ["apiVersion", "kind"],
            "the type has no place for these two"
        );
        assert_eq!(r.retry(0), None);
        let retry = r.retry(1).unwrap();
        assert_eq!(retry.codes.as_deref(), Some(&[503][..]));
        assert_eq!(retry.attempts, Some(2));
        assert_eq!(retry.backoff.as_deref(), Some("100ms"));
        let back = serde_json::to_value(&r).unwrap();
        assert_eq!(
            back["spec"]["rules"][1]["retry"],
            v["spec"]["rules"][1]["retry"]
        );
        assert!(back["spec"]["rules"][0].get("retry").is_none());
    }

    #[test]
    fn retry_errors_and_unknown_fields_name_their_own_path() {
        let v = route(serde_json::json!([{}, {"retry": {"attempts": "two"}}]));
        let e = HTTPRoute::from_value(v).unwrap_err();
        assert_eq!(e.path, "spec.rules[1].retry.attempts");
        let v = route(serde_json::json!([{"retry": {"attemps": 2}}]));
        let (_, ignored) = HTTPRoute::from_value(v).unwrap();
        assert_eq!(
            ignored,
            ["apiVersion", "kind", "spec.rules[0].retry.attemps"]
        );
    }
}
