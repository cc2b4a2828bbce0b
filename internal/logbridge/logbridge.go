// Package logbridge hands the binary's zerolog logger to the public
// packages, which take the standard library's *slog.Logger, so that their
// records come out in the same format, at the same level and with the same
// fields as the relay's own.
package logbridge

import (
	"context"
	"log/slog"

	"github.com/rs/zerolog"
)

// Slog returns a *slog.Logger writing through l.
func Slog(l zerolog.Logger) *slog.Logger {
	return slog.New(&handler{l: l})
}

type handler struct {
	l zerolog.Logger
	// prefix is the open groups, "a.b.", prepended to later keys.
	prefix string
}

func level(l slog.Level) zerolog.Level {
	switch {
	case l >= slog.LevelError:
		return zerolog.ErrorLevel
	case l >= slog.LevelWarn:
		return zerolog.WarnLevel
	case l >= slog.LevelInfo:
		return zerolog.InfoLevel
	default:
		return zerolog.DebugLevel
	}
}

func (h *handler) Enabled(_ context.Context, l slog.Level) bool {
	zl := level(l)
	return zl >= h.l.GetLevel() && zl >= zerolog.GlobalLevel()
}

func (h *handler) Handle(_ context.Context, r slog.Record) error {
	ev := h.l.WithLevel(level(r.Level))
	if ev == nil {
		return nil
	}
	r.Attrs(func(a slog.Attr) bool {
		ev = field(ev, h.prefix, a)
		return true
	})
	ev.Msg(r.Message)
	return nil
}

func (h *handler) WithAttrs(attrs []slog.Attr) slog.Handler {
	c := h.l.With()
	for _, a := range attrs {
		c = contextField(c, h.prefix, a)
	}
	return &handler{l: c.Logger(), prefix: h.prefix}
}

func (h *handler) WithGroup(name string) slog.Handler {
	if name == "" {
		return h
	}
	return &handler{l: h.l, prefix: h.prefix + name + "."}
}

// field adds a to ev under prefix, flattening groups into dotted keys.
func field(ev *zerolog.Event, prefix string, a slog.Attr) *zerolog.Event {
	v := a.Value.Resolve()
	if a.Equal(slog.Attr{}) {
		return ev
	}
	key := prefix + a.Key
	switch v.Kind() {
	case slog.KindGroup:
		p := prefix
		if a.Key != "" {
			p = key + "."
		}
		for _, g := range v.Group() {
			ev = field(ev, p, g)
		}
		return ev
	case slog.KindString:
		return ev.Str(key, v.String())
	case slog.KindInt64:
		return ev.Int64(key, v.Int64())
	case slog.KindUint64:
		return ev.Uint64(key, v.Uint64())
	case slog.KindFloat64:
		return ev.Float64(key, v.Float64())
	case slog.KindBool:
		return ev.Bool(key, v.Bool())
	case slog.KindDuration:
		return ev.Dur(key, v.Duration())
	case slog.KindTime:
		return ev.Time(key, v.Time())
	}
	if err, ok := v.Any().(error); ok {
		return ev.AnErr(key, err)
	}
	return ev.Interface(key, v.Any())
}

// contextField is field for a logger's fixed attributes.
func contextField(c zerolog.Context, prefix string, a slog.Attr) zerolog.Context {
	v := a.Value.Resolve()
	if a.Equal(slog.Attr{}) {
		return c
	}
	key := prefix + a.Key
	switch v.Kind() {
	case slog.KindGroup:
		p := prefix
		if a.Key != "" {
			p = key + "."
		}
		for _, g := range v.Group() {
			c = contextField(c, p, g)
		}
		return c
	case slog.KindString:
		return c.Str(key, v.String())
	case slog.KindInt64:
		return c.Int64(key, v.Int64())
	case slog.KindUint64:
		return c.Uint64(key, v.Uint64())
	case slog.KindFloat64:
		return c.Float64(key, v.Float64())
	case slog.KindBool:
		return c.Bool(key, v.Bool())
	case slog.KindDuration:
		return c.Dur(key, v.Duration())
	case slog.KindTime:
		return c.Time(key, v.Time())
	}
	if err, ok := v.Any().(error); ok {
		return c.AnErr(key, err)
	}
	return c.Interface(key, v.Any())
}
