//! How long a failed delivery waits before the next one, and how many it gets.

use std::time::Duration;

/// Exponential backoff with jitter and a cap, and the number of deliveries before a job is
/// dead-lettered.
#[derive(Clone, Debug, PartialEq)]
pub struct RetryPolicy {
    /// The delay after the first failure.
    pub base: Duration,
    /// The longest delay.
    pub cap: Duration,
    /// Deliveries before a failing job is dead-lettered; `None` retries forever.
    pub max_attempts: Option<i32>,
    /// The fraction of each delay drawn at random (0: none, 1: anywhere from zero to the delay),
    /// so jobs that failed together do not all come back together.
    pub jitter: f64,
}

impl Default for RetryPolicy {
    /// 1 s doubling to at most 10 min, half of it jittered, 25 deliveries.
    fn default() -> Self {
        Self {
            base: Duration::from_secs(1),
            cap: Duration::from_secs(600),
            max_attempts: Some(25),
            jitter: 0.5,
        }
    }
}

impl RetryPolicy {
    /// The delay before the delivery after failed delivery `attempt` (1-based).
    pub fn delay(&self, attempt: i32) -> Duration {
        let doublings = attempt.saturating_sub(1).clamp(0, 62) as u32;
        let full = self
            .base
            .checked_mul(1u32.checked_shl(doublings.min(31)).unwrap_or(u32::MAX))
            .unwrap_or(self.cap)
            .min(self.cap);
        let jitter = self.jitter.clamp(0.0, 1.0);
        full.mul_f64(1.0 - jitter * fastrand::f64())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_double_up_to_the_cap_with_bounded_jitter() {
        let policy = RetryPolicy {
            base: Duration::from_millis(100),
            cap: Duration::from_secs(1),
            max_attempts: None,
            jitter: 0.5,
        };
        for _ in 0..100 {
            let first = policy.delay(1);
            assert!(first <= Duration::from_millis(100) && first >= Duration::from_millis(50));
            let third = policy.delay(3);
            assert!(third <= Duration::from_millis(400) && third >= Duration::from_millis(200));
            assert!(policy.delay(40) <= Duration::from_secs(1));
            assert!(policy.delay(40) >= Duration::from_millis(500));
        }
        let exact = RetryPolicy {
            jitter: 0.0,
            ..policy
        };
        assert_eq!(exact.delay(2), Duration::from_millis(200));
        assert_eq!(exact.delay(i32::MAX), Duration::from_secs(1));
    }
}
