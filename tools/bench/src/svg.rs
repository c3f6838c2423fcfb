//! A line chart written as SVG by hand (a plotting crate would bring dozens of crates for
//! one picture): drain rate against batch size, one line per channel count, with the
//! broker ceiling measured next to each point as a dashed line in the same colour.

use crate::stats::thousands;
use std::fmt::Write;

pub struct Series {
    pub label: String,
    /// (x category index, y) points; x positions are the chart's categories.
    pub points: Vec<(usize, f64)>,
    /// A reference line drawn dashed (the broker ceiling measured next to each point).
    pub reference: Vec<(usize, f64)>,
}

const COLOURS: [&str; 6] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b",
];

/// Renders the chart. `categories` label the x axis left to right.
pub fn line_chart(
    title: &str,
    x_label: &str,
    y_label: &str,
    categories: &[String],
    series: &[Series],
) -> String {
    let (w, h) = (760.0, 440.0);
    let (left, right, top, bottom) = (80.0, 200.0, 50.0, 60.0);
    let plot_w = w - left - right;
    let plot_h = h - top - bottom;
    let y_max_data = series
        .iter()
        .flat_map(|s| {
            s.points
                .iter()
                .map(|p| p.1)
                .chain(s.reference.iter().map(|p| p.1))
        })
        .fold(0.0_f64, f64::max);
    let (y_max, step) = nice_axis(y_max_data);
    let x_of = |i: usize| {
        if categories.len() <= 1 {
            left + plot_w / 2.0
        } else {
            left + plot_w * i as f64 / (categories.len() - 1) as f64
        }
    };
    let y_of = |v: f64| top + plot_h * (1.0 - v / y_max);

    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="{w}" height="{h}" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{}" y="24" font-size="15" text-anchor="middle">{}</text>"#,
        left + plot_w / 2.0,
        escape(title)
    );
    // Horizontal grid and y labels.
    let mut v = 0.0;
    while v <= y_max + step * 0.01 {
        let y = y_of(v);
        let _ = writeln!(
            s,
            r##"<line x1="{left}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
            left + plot_w,
            left - 6.0,
            y + 4.0,
            thousands(v)
        );
        v += step;
    }
    // X ticks.
    for (i, c) in categories.iter().enumerate() {
        let x = x_of(i);
        let _ = writeln!(
            s,
            r##"<line x1="{x:.1}" y1="{:.1}" x2="{x:.1}" y2="{:.1}" stroke="#999"/><text x="{x:.1}" y="{:.1}" text-anchor="middle">{}</text>"##,
            top + plot_h,
            top + plot_h + 5.0,
            top + plot_h + 20.0,
            escape(c)
        );
    }
    let _ = writeln!(
        s,
        r##"<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#333"/>"##
    );
    let _ = writeln!(
        s,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
        left + plot_w / 2.0,
        h - 15.0,
        escape(x_label)
    );
    let _ = writeln!(
        s,
        r#"<text x="18" y="{:.1}" text-anchor="middle" transform="rotate(-90 18 {:.1})">{}</text>"#,
        top + plot_h / 2.0,
        top + plot_h / 2.0,
        escape(y_label)
    );
    // Series and legend.
    for (k, ser) in series.iter().enumerate() {
        let colour = COLOURS[k % COLOURS.len()];
        if !ser.reference.is_empty() {
            let pts: Vec<String> = ser
                .reference
                .iter()
                .map(|(i, v)| format!("{:.1},{:.1}", x_of(*i), y_of(*v)))
                .collect();
            let _ = writeln!(
                s,
                r#"<polyline points="{}" fill="none" stroke="{colour}" stroke-dasharray="6 4" stroke-width="1.5"/>"#,
                pts.join(" ")
            );
        }
        let pts: Vec<String> = ser
            .points
            .iter()
            .map(|(i, v)| format!("{:.1},{:.1}", x_of(*i), y_of(*v)))
            .collect();
        let _ = writeln!(
            s,
            r#"<polyline points="{}" fill="none" stroke="{colour}" stroke-width="2.5"/>"#,
            pts.join(" ")
        );
        for (i, v) in &ser.points {
            let _ = writeln!(
                s,
                r#"<circle cx="{:.1}" cy="{:.1}" r="3.5" fill="{colour}"/>"#,
                x_of(*i),
                y_of(*v)
            );
        }
        let ly = top + 10.0 + 40.0 * k as f64;
        let lx = left + plot_w + 15.0;
        let _ = writeln!(
            s,
            r#"<line x1="{lx}" y1="{ly}" x2="{:.1}" y2="{ly}" stroke="{colour}" stroke-width="2.5"/><text x="{:.1}" y="{:.1}">{}</text>"#,
            lx + 24.0,
            lx + 30.0,
            ly + 4.0,
            escape(&ser.label)
        );
        if !ser.reference.is_empty() {
            let _ = writeln!(
                s,
                r#"<line x1="{lx}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="{colour}" stroke-dasharray="6 4" stroke-width="1.5"/><text x="{:.1}" y="{:.1}">broker ceiling</text>"#,
                ly + 18.0,
                lx + 24.0,
                ly + 18.0,
                lx + 30.0,
                ly + 22.0
            );
        }
    }
    s.push_str("</svg>\n");
    s
}

/// A round axis maximum above `max` and a tick step giving 4 to 8 ticks.
fn nice_axis(max: f64) -> (f64, f64) {
    if max <= 0.0 || !max.is_finite() {
        return (1.0, 0.25);
    }
    let raw = max * 1.1 / 5.0;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * mag);
    ((max * 1.1 / step).ceil() * step, step)
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chart_is_one_svg_with_a_line_per_series() {
        let svg = line_chart(
            "t <1>",
            "batch",
            "events/s",
            &["100".into(), "500".into()],
            &[
                Series {
                    label: "1 channel".into(),
                    points: vec![(0, 1000.0), (1, 2000.0)],
                    reference: vec![(0, 5000.0), (1, 4800.0)],
                },
                Series {
                    label: "2 channels".into(),
                    points: vec![(0, 1500.0), (1, 2500.0)],
                    reference: Vec::new(),
                },
            ],
        );
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert_eq!(svg.matches("<polyline").count(), 3);
        assert!(svg.contains("t &lt;1&gt;"));
    }

    #[test]
    fn axis_is_round_and_above_the_data() {
        let (max, step) = nice_axis(17_345.0);
        assert!(
            max >= 17_345.0 && (max / step).round() <= 8.0,
            "{max} {step}"
        );
        assert_eq!(nice_axis(0.0), (1.0, 0.25));
    }
}
