// A small line plot on a <canvas>: series of [x, y] points, axes with a few labelled grid lines, an
// optional horizontal reference line and a legend. Redrawn whole on every update.

const PAD = { left: 48, right: 10, top: 22, bottom: 22 };

function niceMax(value) {
  if (!(value > 0)) return 1;
  const step = 10 ** Math.floor(Math.log10(value));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * step >= value) return m * step;
  return 10 * step;
}

function label(value) {
  if (Math.abs(value) >= 1000) return `${Math.round(value)}`;
  if (Math.abs(value) >= 10) return value.toFixed(0);
  if (Math.abs(value) >= 1) return value.toFixed(1);
  return value.toFixed(2);
}

/**
 * options: {series: [{label, color, points: [[x, y], ...]}], xMin, xMax, yMax, reference: {y, label},
 * xLabel(x) -> string}
 */
export function drawPlot(canvas, { series, xMin, xMax, yMax, reference, xLabel = label, empty = "no data yet" }) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth;
  const height = canvas.clientHeight;
  if (!width || !height) return; // hidden
  canvas.width = Math.round(width * ratio);
  canvas.height = Math.round(height * ratio);
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, height);
  const style = getComputedStyle(document.documentElement);
  const muted = style.getPropertyValue("--muted").trim() || "#888";
  const line = style.getPropertyValue("--line").trim() || "#ccc";
  ctx.font = "11px system-ui, sans-serif";
  const points = series.flatMap((s) => s.points);
  if (!points.length) {
    ctx.fillStyle = muted;
    ctx.fillText(empty, PAD.left, height / 2);
    return;
  }
  const x0 = xMin ?? Math.min(...points.map((p) => p[0]));
  let x1 = xMax ?? Math.max(...points.map((p) => p[0]));
  if (x1 <= x0) x1 = x0 + 1;
  const top = niceMax(Math.max(yMax ?? 0, ...points.map((p) => p[1]), reference ? reference.y * 1.1 : 0));
  const plotW = width - PAD.left - PAD.right;
  const plotH = height - PAD.top - PAD.bottom;
  const sx = (x) => PAD.left + ((x - x0) / (x1 - x0)) * plotW;
  const sy = (y) => PAD.top + plotH - (y / top) * plotH;

  ctx.strokeStyle = line;
  ctx.fillStyle = muted;
  ctx.lineWidth = 1;
  for (let i = 0; i <= 4; i++) {
    const y = (top * i) / 4;
    ctx.beginPath();
    ctx.moveTo(PAD.left, sy(y));
    ctx.lineTo(width - PAD.right, sy(y));
    ctx.stroke();
    ctx.fillText(label(y), 4, sy(y) + 4);
  }
  ctx.fillText(xLabel(x0), PAD.left, height - 6);
  const last = xLabel(x1);
  ctx.fillText(last, width - PAD.right - ctx.measureText(last).width, height - 6);

  if (reference) {
    ctx.save();
    ctx.setLineDash([4, 4]);
    ctx.strokeStyle = muted;
    ctx.beginPath();
    ctx.moveTo(PAD.left, sy(reference.y));
    ctx.lineTo(width - PAD.right, sy(reference.y));
    ctx.stroke();
    ctx.restore();
    if (reference.label) ctx.fillText(reference.label, PAD.left + 4, sy(reference.y) - 4);
  }

  let legendX = PAD.left;
  for (const s of series) {
    ctx.strokeStyle = s.color;
    ctx.fillStyle = s.color;
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    s.points.forEach(([x, y], i) => (i ? ctx.lineTo(sx(x), sy(y)) : ctx.moveTo(sx(x), sy(y))));
    ctx.stroke();
    for (const [x, y] of s.points) {
      ctx.beginPath();
      ctx.arc(sx(x), sy(y), 2.5, 0, 2 * Math.PI);
      ctx.fill();
    }
    ctx.fillRect(legendX, 6, 10, 10);
    ctx.fillStyle = muted;
    ctx.fillText(s.label, legendX + 14, 15);
    legendX += 24 + ctx.measureText(s.label).width;
  }
}
