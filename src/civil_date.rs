//! Calendar dates from Unix time, without a date library: what the log files' timestamps
//! and the certificates' validity dates both need.

/// Year, month and day (UTC) of day `days` since 1970-01-01 (civil-from-days, proleptic
/// Gregorian, after Howard Hinnant's derivation).
pub fn from_days(days: i64) -> (i64, u8, u8) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month as u8, day as u8)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn days_map_to_their_dates_across_leap_years() {
        assert_eq!(from_days(0), (1970, 1, 1));
        assert_eq!(from_days(-1), (1969, 12, 31));
        assert_eq!(from_days(11_016), (2000, 2, 29));
        assert_eq!(from_days(20_784), (2026, 11, 27));
    }
}
