//! The standard `process_*` metrics of a Prometheus exporter (CPU, memory, descriptors, threads,
//! start time), read from `/proc/self` at each scrape, so that dashboards and alerts written for
//! any exporter (descriptors near their limit, memory growth) work for a site unchanged. Other
//! systems than Linux report none.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Unit;

/// Clock ticks per second of `/proc/<pid>/stat`'s times: `USER_HZ`, 100 on every Linux
/// architecture user space sees (the Prometheus Go client assumes it too).
const USER_HZ: f64 = 100.0;

#[derive(Debug, Default)]
pub struct ProcessCollector;

/// What one scrape read.
#[derive(Debug, Default, PartialEq)]
struct Sample {
    cpu_seconds: f64,
    threads: i64,
    virtual_bytes: i64,
    resident_bytes: i64,
    start_time_seconds: f64,
    open_fds: Option<i64>,
    max_fds: Option<i64>,
}

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some(s) = sample() else {
            return Ok(());
        };
        let counter = |e: &mut DescriptorEncoder, name, help, unit, v: f64| {
            ConstCounter::new(v).encode(e.encode_descriptor(
                name,
                help,
                unit,
                MetricType::Counter,
            )?)
        };
        let gauge = |e: &mut DescriptorEncoder, name, help, unit, v: i64| {
            ConstGauge::new(v).encode(e.encode_descriptor(name, help, unit, MetricType::Gauge)?)
        };
        counter(
            &mut encoder,
            "process_cpu",
            "Total user and system CPU time spent in seconds.",
            Some(&Unit::Seconds),
            s.cpu_seconds,
        )?;
        gauge(
            &mut encoder,
            "process_resident_memory",
            "Resident memory size in bytes.",
            Some(&Unit::Bytes),
            s.resident_bytes,
        )?;
        gauge(
            &mut encoder,
            "process_virtual_memory",
            "Virtual memory size in bytes.",
            Some(&Unit::Bytes),
            s.virtual_bytes,
        )?;
        gauge(
            &mut encoder,
            "process_threads",
            "Number of OS threads in the process.",
            None,
            s.threads,
        )?;
        if let Some(n) = s.open_fds {
            gauge(
                &mut encoder,
                "process_open_fds",
                "Number of open file descriptors.",
                None,
                n,
            )?;
        }
        if let Some(n) = s.max_fds {
            gauge(
                &mut encoder,
                "process_max_fds",
                "Maximum number of open file descriptors.",
                None,
                n,
            )?;
        }
        ConstGauge::new(s.start_time_seconds).encode(encoder.encode_descriptor(
            "process_start_time",
            "Start time of the process since unix epoch in seconds.",
            Some(&Unit::Seconds),
            MetricType::Gauge,
        )?)
    }
}

fn sample() -> Option<Sample> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let boot = std::fs::read_to_string("/proc/stat").ok()?;
    let mut s = parse(&stat, &status, &boot)?;
    s.open_fds = std::fs::read_dir("/proc/self/fd")
        .ok()
        .map(|d| d.count() as i64);
    s.max_fds = std::fs::read_to_string("/proc/self/limits")
        .ok()
        .and_then(|l| max_open_files(&l));
    Some(s)
}

/// The figures of `/proc/self/stat`, `/proc/self/status` and `/proc/stat` (for the boot time).
fn parse(stat: &str, status: &str, proc_stat: &str) -> Option<Sample> {
    // The command name is in parentheses and may hold spaces or parentheses itself: the fields
    // that count come after the last `)`, starting with field 3 (state).
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let field = |n: usize| fields.get(n - 3).and_then(|f| f.parse::<u64>().ok());
    let (utime, stime) = (field(14)?, field(15)?);
    let start_ticks = field(22)?;
    let kib = |key: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<i64>().ok())
    };
    let boot_time = proc_stat
        .lines()
        .find_map(|l| l.strip_prefix("btime "))
        .and_then(|v| v.trim().parse::<u64>().ok())?;
    Some(Sample {
        cpu_seconds: (utime + stime) as f64 / USER_HZ,
        threads: field(20)? as i64,
        virtual_bytes: field(23)? as i64,
        resident_bytes: kib("VmRSS:").unwrap_or(0) * 1024,
        start_time_seconds: boot_time as f64 + start_ticks as f64 / USER_HZ,
        open_fds: None,
        max_fds: None,
    })
}

/// The soft limit of `Max open files` in `/proc/self/limits`; `None` when unlimited.
fn max_open_files(limits: &str) -> Option<i64> {
    let rest = limits
        .lines()
        .find_map(|l| l.strip_prefix("Max open files"))?;
    rest.split_whitespace().next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    const STAT: &str = "4242 (key way (x)) S 1 4242 4242 0 -1 4194560 2131 0 0 0 250 75 0 0 20 0 9 0 123400 987654321 5432 18446744073709551615 1 1 0 0 0 0 0 4096 17663 0 0 0 17 1 0 0 0 0 0";
    const STATUS: &str = "Name:\tkeyway\nVmSize:\t  964508 kB\nVmRSS:\t   21728 kB\nThreads:\t9\n";
    const PROC_STAT: &str = "cpu  1 2 3\nbtime 1764979200\nprocesses 100\n";
    const LIMITS: &str = "Limit                     Soft Limit           Hard Limit           Units     \nMax cpu time              unlimited            unlimited            seconds   \nMax open files            1024                 524288               files     \n";

    #[test]
    fn proc_files_are_read_past_a_command_name_with_spaces_and_parentheses() {
        let s = parse(STAT, STATUS, PROC_STAT).expect("parsed");
        assert_eq!(s.cpu_seconds, 3.25);
        assert_eq!(s.threads, 9);
        assert_eq!(s.virtual_bytes, 987_654_321);
        assert_eq!(s.resident_bytes, 21_728 * 1024);
        assert_eq!(s.start_time_seconds, 1_764_979_200.0 + 1234.0);
        assert_eq!(max_open_files(LIMITS), Some(1024));
        assert_eq!(
            max_open_files(
                "Max open files            unlimited            unlimited            files\n"
            ),
            None
        );
    }

    #[test]
    fn truncated_files_give_nothing_rather_than_wrong_figures() {
        assert_eq!(parse("4242 (keyway) S 1 2", STATUS, PROC_STAT), None);
        assert_eq!(parse("garbage", STATUS, PROC_STAT), None);
        assert_eq!(parse(STAT, STATUS, "cpu 1 2 3\n"), None);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn this_process_is_sampled() {
        let s = sample().expect("sampled");
        assert!(s.threads >= 1);
        assert!(s.resident_bytes > 0);
        assert!(s.open_fds.is_some_and(|n| n >= 3));
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_secs_f64();
        assert!(s.start_time_seconds <= now + 1.0 && s.start_time_seconds > now - 86_400.0 * 365.0);
    }
}
