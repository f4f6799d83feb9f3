//! The SVG plot of GiB/s against block size: kvxfer and its baselines.

/// A byte count as `64K`, `2M`, `1G` when it is a whole multiple, else in bytes.
pub(crate) fn human(b: u64) -> String {
    match b {
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{}G", b >> 30),
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{}M", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{}K", b >> 10),
        b => b.to_string(),
    }
}

/// One block size's bandwidths, for the plot.
pub(crate) struct PlotRow {
    pub(crate) block: u64,
    pub(crate) kvxfer: f64,
    pub(crate) raw_tcp: Option<f64>,
    pub(crate) memcpy: Option<f64>,
}

type Series = (&'static str, &'static str, fn(&PlotRow) -> Option<f64>);

/// Draws `rows` into an SVG file at `path`.
pub(crate) fn svg_plot(path: &str, transport: &str, rows: &[PlotRow]) -> Result<(), String> {
    let (w, h, m) = (720.0, 420.0, 60.0);
    let max =
        rows.iter().flat_map(|r| [Some(r.kvxfer), r.raw_tcp, r.memcpy]).flatten().fold(0.1f64, f64::max)
            * 1.1;
    let xs: Vec<f64> = rows.iter().map(|r| (r.block as f64).log2()).collect();
    let (x0, x1) = (xs.iter().copied().fold(f64::MAX, f64::min), xs.iter().copied().fold(f64::MIN, f64::max));
    let px = |x: f64| m + if x1 > x0 { (x - x0) / (x1 - x0) * (w - 2.0 * m) } else { (w - 2.0 * m) / 2.0 };
    let py = |y: f64| h - m - y / max * (h - 2.0 * m);
    let mut svg = format!(
        "<svg xmlns='http://www.w3.org/2000/svg' width='{w}' height='{h}' font-family='sans-serif' font-size='12'>\n\
         <rect width='100%' height='100%' fill='white'/>\n\
         <line x1='{m}' y1='{}' x2='{}' y2='{}' stroke='black'/><line x1='{m}' y1='{m}' x2='{m}' y2='{}' stroke='black'/>\n\
         <text x='{}' y='{}' text-anchor='middle'>block size</text>\
         <text x='15' y='{}' transform='rotate(-90 15 {})' text-anchor='middle'>GiB/s</text>\n",
        h - m, w - m, h - m, h - m, w / 2.0, h - 15.0, h / 2.0, h / 2.0
    );
    for (i, r) in rows.iter().enumerate() {
        svg += &format!(
            "<text x='{}' y='{}' text-anchor='middle'>{}</text>\n",
            px(xs[i]),
            h - m + 18.0,
            human(r.block)
        );
    }
    for k in 0..=4 {
        let v = max * f64::from(k) / 4.0;
        svg += &format!("<text x='{}' y='{}' text-anchor='end'>{v:.1}</text>\n", m - 6.0, py(v) + 4.0);
    }
    let series: [Series; 3] = [
        ("kvxfer", "#1f77b4", |r| Some(r.kvxfer)),
        ("raw TCP", "#ff7f0e", |r| r.raw_tcp),
        ("memcpy", "#2ca02c", |r| r.memcpy),
    ];
    for (si, (name, color, get)) in series.iter().enumerate() {
        let pts: Vec<String> = rows
            .iter()
            .enumerate()
            .filter_map(|(i, r)| get(r).map(|v| format!("{},{}", px(xs[i]), py(v))))
            .collect();
        if pts.is_empty() {
            continue;
        }
        let label = if si == 0 { format!("kvxfer ({transport})") } else { (*name).to_owned() };
        svg += &format!(
            "<polyline fill='none' stroke='{color}' stroke-width='2' points='{}'/>\n",
            pts.join(" ")
        );
        for p in &pts {
            let (x, y) = p.split_once(',').unwrap_or(("0", "0"));
            svg += &format!("<circle cx='{x}' cy='{y}' r='3' fill='{color}'/>\n");
        }
        svg += &format!(
            "<text x='{}' y='{}' fill='{color}'>{label}</text>\n",
            w - m - 140.0,
            m + 16.0 * si as f64
        );
    }
    svg += "</svg>\n";
    std::fs::write(path, svg).map_err(|e| format!("writing {path}: {e}"))
}

/// Draws the many-requests workload into an SVG file at `path`: per-child hand-off latency
/// (p50, p99, p999; log scale) against the parents in flight (closed loop, log scale) and,
/// in a second panel below, against the parents offered per second (open loop, log scale);
/// one set of lines per block size.
pub(crate) fn svg_latency_plot(
    path: &str,
    transport: &str,
    rows: &[crate::types::Loaded],
) -> Result<(), String> {
    use crate::types::Level;
    let (w, h) = (720.0, 420.0);
    let closed: Vec<&crate::types::Loaded> =
        rows.iter().filter(|r| matches!(r.level, Level::Closed(_))).collect();
    let open: Vec<&crate::types::Loaded> =
        rows.iter().filter(|r| matches!(r.level, Level::Open { .. })).collect();
    let panels: Vec<(&[&crate::types::Loaded], String)> = [
        (closed.as_slice(), "parents in flight (C), closed loop".to_owned()),
        (
            open.as_slice(),
            "parents offered per second, open loop (latency from scheduled arrival)".to_owned(),
        ),
    ]
    .into_iter()
    .filter(|(r, _)| !r.is_empty())
    .collect();
    let total_h = h * panels.len().max(1) as f64;
    let mut svg = format!(
        "<svg xmlns='http://www.w3.org/2000/svg' width='{w}' height='{total_h}' font-family='sans-serif' font-size='12'>\n\
         <rect width='100%' height='100%' fill='white'/>\n"
    );
    for (i, (rows, xlabel)) in panels.iter().enumerate() {
        svg += &latency_panel(rows, transport, xlabel, h * i as f64);
    }
    svg += "</svg>\n";
    std::fs::write(path, svg).map_err(|e| format!("writing {path}: {e}"))
}

/// One panel of [`svg_latency_plot`] (720 x 420, `top` pixels down): latency quantiles of
/// `rows` against their level (`Loaded::x`), both on log scales.
fn latency_panel(rows: &[&crate::types::Loaded], transport: &str, xlabel: &str, top: f64) -> String {
    let (w, h, m) = (720.0, 420.0, 70.0);
    let lat = |v: f64| v.max(1.0).log10();
    let ys: Vec<f64> = rows.iter().flat_map(|r| r.child_us[..3].iter().map(|&v| lat(v))).collect();
    let (y0, y1) = (
        ys.iter().copied().fold(f64::MAX, f64::min).floor(),
        ys.iter().copied().fold(f64::MIN, f64::max).ceil().max(1.0),
    );
    let xs: Vec<f64> = rows.iter().map(|r| r.x().max(1.0).log2()).collect();
    let (x0, x1) = (xs.iter().copied().fold(f64::MAX, f64::min), xs.iter().copied().fold(f64::MIN, f64::max));
    let px = |x: f64| m + if x1 > x0 { (x - x0) / (x1 - x0) * (w - 2.0 * m) } else { (w - 2.0 * m) / 2.0 };
    let py = |y: f64| top + h - m - if y1 > y0 { (y - y0) / (y1 - y0) * (h - 2.0 * m) } else { 0.0 };
    let (bottom, mid) = (top + h - m, top + h / 2.0);
    let mut svg = format!(
        "<line x1='{m}' y1='{bottom}' x2='{}' y2='{bottom}' stroke='black'/><line x1='{m}' y1='{}' x2='{m}' y2='{bottom}' stroke='black'/>\n\
         <text x='{}' y='{}' text-anchor='middle'>{xlabel}</text>\
         <text x='15' y='{mid}' transform='rotate(-90 15 {mid})' text-anchor='middle'>hand-off latency, us ({transport})</text>\n",
        w - m,
        top + m,
        w / 2.0,
        top + h - 15.0,
    );
    let mut seen_x = Vec::new();
    for (i, r) in rows.iter().enumerate() {
        if !seen_x.contains(&r.x().to_bits()) {
            seen_x.push(r.x().to_bits());
            svg += &format!(
                "<text x='{}' y='{}' text-anchor='middle'>{}</text>\n",
                px(xs[i]),
                bottom + 18.0,
                r.x()
            );
        }
    }
    let mut decade = y0;
    while decade <= y1 {
        svg += &format!(
            "<text x='{}' y='{}' text-anchor='end'>{}</text>\n",
            m - 6.0,
            py(decade) + 4.0,
            10f64.powf(decade)
        );
        decade += 1.0;
    }
    let colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"];
    let mut blocks: Vec<u64> = rows.iter().map(|r| r.block).collect();
    blocks.dedup();
    let mut legend = 0.0;
    for (bi, block) in blocks.iter().enumerate() {
        for (qi, (q, dash)) in [("p50", ""), ("p99", "6,3"), ("p999", "2,3")].iter().enumerate() {
            let color = colors[bi % colors.len()];
            let pts: Vec<String> = rows
                .iter()
                .enumerate()
                .filter(|(_, r)| r.block == *block)
                .map(|(i, r)| format!("{},{}", px(xs[i]), py(lat(r.child_us[qi]))))
                .collect();
            svg += &format!(
                "<polyline fill='none' stroke='{color}' stroke-width='2' stroke-dasharray='{dash}' points='{}'/>\n",
                pts.join(" ")
            );
            svg += &format!(
                "<text x='{}' y='{}' fill='{color}'>{} blocks, {q}</text>\n",
                w - m - 150.0,
                top + m + 16.0 * legend,
                human(*block)
            );
            legend += 1.0;
        }
    }
    svg
}
