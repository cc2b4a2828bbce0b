package bench

import (
	"image/color"
	"slices"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
)

var palette = map[string]color.Color{
	CDCLive:    color.RGBA{R: 0x1f, G: 0x77, B: 0xb4, A: 0xff},
	PollLive:   color.RGBA{R: 0xd6, G: 0x27, B: 0x28, A: 0xff},
	PollerLive: color.RGBA{R: 0x2c, G: 0xa0, B: 0x2c, A: 0xff},
}

// Plot writes a PNG: above, the commit-to-ack latency histogram of the live
// cases (up to their p99.9, so one outlier does not flatten it); below, the
// messages received per second over time.
func Plot(path string, rep Report) error {
	hist := plot.New()
	hist.Title.Text = "commit-to-ack latency (live cases, median round)"
	hist.X.Label.Text = "ms"
	hist.Y.Label.Text = "share of messages"
	hist.Legend.Top = true
	tp := plot.New()
	tp.Title.Text = "messages received per second"
	tp.X.Label.Text = "s since the first insert"
	tp.Y.Label.Text = "msg/s"
	tp.Legend.Top = true
	for _, r := range rep.Medians {
		col, ok := palette[r.Case]
		if !ok || len(r.Latencies) == 0 {
			continue
		}
		v := slices.Clone(r.Latencies)
		slices.Sort(v)
		cut := v[:max(1, len(v)*999/1000)]
		h, err := plotter.NewHist(plotter.Values(cut), 60)
		if err != nil {
			return err
		}
		h.Normalize(1)
		h.FillColor = nil
		h.LineStyle.Color = col
		h.LineStyle.Width = vg.Points(1.5)
		hist.Add(h)
		hist.Legend.Add(r.Case, h)

		pts := make(plotter.XYs, len(r.Throughput))
		for i, c := range r.Throughput {
			pts[i] = plotter.XY{X: float64(i) / 10, Y: float64(c) * 10}
		}
		if len(pts) > 0 {
			l, err := plotter.NewLine(pts)
			if err != nil {
				return err
			}
			l.LineStyle.Color = col
			tp.Add(l)
			tp.Legend.Add(r.Case, l)
		}
	}
	img := vgimg.New(8*vg.Inch, 9*vg.Inch)
	dc := draw.New(img)
	tiles := draw.Tiles{Rows: 2, Cols: 1, PadX: vg.Millimeter * 4, PadY: vg.Millimeter * 6, PadTop: vg.Millimeter * 2, PadBottom: vg.Millimeter * 2, PadLeft: vg.Millimeter * 2, PadRight: vg.Millimeter * 4}
	canvases := plot.Align([][]*plot.Plot{{hist}, {tp}}, tiles, dc)
	hist.Draw(canvases[0][0])
	tp.Draw(canvases[1][0])
	return savePNG(path, img)
}
