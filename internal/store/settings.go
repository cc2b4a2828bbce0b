package store

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/outbox-relay/outbox-relay/internal/termsafe"
)

// Settings are what every instance of one table must run with (DESIGN.md,
// Several instances). The held state of --ordering aggregate lives in the
// table, so an instance without it would publish a held aggregate's later
// rows past its earlier one; --on-publish decides what the table holds once a
// row is out. Both are recorded in <table>_settings by the first instance.
type Settings struct {
	Ordering  string // "none" or "aggregate"
	OnPublish Policy
}

func (s Settings) normal() Settings {
	if s.Ordering == "" {
		s.Ordering = "none"
	}
	if s.OnPublish == "" {
		s.OnPublish = PolicyMark
	}
	return s
}

// Flags is s as the command line gives it.
func (s Settings) Flags() string {
	s = s.normal()
	return "--ordering " + s.Ordering + " --on-publish " + string(s.OnPublish)
}

// RecordedSettings is the record of a table's settings.
type RecordedSettings struct {
	Settings
	RecordedAt time.Time
	RecordedBy string
}

// ErrSettingsDiffer says an instance was started with settings that differ
// from those recorded for its table.
var ErrSettingsDiffer = errors.New("this instance's settings differ from those recorded for table")

// SettingsTable is the quoted name of <table>_settings.
func SettingsTable(t Table) string { return t.Derived("settings", true) }

// ReadSettings reads t's recorded settings; found is false when none are
// recorded yet (no instance has run since migration 0009).
func ReadSettings(ctx context.Context, db DBTX, t Table) (rec RecordedSettings, found bool, err error) {
	err = db.QueryRow(ctx, `SELECT ordering, on_publish, recorded_at, recorded_by FROM `+SettingsTable(t)).
		Scan(&rec.Ordering, &rec.OnPublish, &rec.RecordedAt, &rec.RecordedBy)
	if errors.Is(err, pgx.ErrNoRows) {
		return RecordedSettings{}, false, nil
	}
	if err != nil {
		return RecordedSettings{}, false, settingsErr(t, "read", err)
	}
	return rec, true, nil
}

// RecordSettings replaces t's recorded settings with s (migrate
// --record-settings) and returns the record it replaced, if any.
func RecordSettings(ctx context.Context, db DBTX, t Table, s Settings, by string) (prev RecordedSettings, found bool, err error) {
	s = s.normal()
	// The old row is read in the same statement, so two operators changing
	// it at once each see what they replaced.
	var ordering, onPublish, recBy *string
	var recAt *time.Time
	err = db.QueryRow(ctx, `WITH old AS (SELECT ordering, on_publish, recorded_at, recorded_by FROM `+SettingsTable(t)+` FOR UPDATE),
		upsert AS (
			INSERT INTO `+SettingsTable(t)+` (singleton, ordering, on_publish, recorded_at, recorded_by)
			VALUES (true, $1, $2, clock_timestamp(), $3)
			ON CONFLICT (singleton) DO UPDATE SET ordering = EXCLUDED.ordering, on_publish = EXCLUDED.on_publish,
				recorded_at = EXCLUDED.recorded_at, recorded_by = EXCLUDED.recorded_by
			RETURNING 1)
		SELECT (SELECT count(*) FROM upsert), o.ordering, o.on_publish, o.recorded_at, o.recorded_by
		FROM (SELECT 1) x LEFT JOIN old o ON true`, s.Ordering, string(s.OnPublish), by).
		Scan(new(int64), &ordering, &onPublish, &recAt, &recBy)
	if err != nil {
		return RecordedSettings{}, false, settingsErr(t, "record", err)
	}
	if ordering == nil {
		return RecordedSettings{}, false, nil
	}
	return RecordedSettings{Settings: Settings{Ordering: *ordering, OnPublish: Policy(*onPublish)}, RecordedAt: *recAt, RecordedBy: *recBy}, true, nil
}

// CheckSettings compares s with the settings recorded for the store's table,
// recording s first when none are (the first instance of the table). It
// returns an error wrapping ErrSettingsDiffer that names each setting that
// differs, the recorded and the given value, and how to change the record.
func (s *Store) CheckSettings(ctx context.Context, want Settings, by string) (rec RecordedSettings, recorded bool, err error) {
	want = want.normal()
	rec, found, err := ReadSettings(ctx, s.pool, s.table)
	if err != nil {
		return RecordedSettings{}, false, err
	}
	if !found {
		// Two first instances at once: one insert wins, the other reads
		// the winner's record and compares with it.
		tag, err := s.pool.Exec(ctx, `INSERT INTO `+SettingsTable(s.table)+` (singleton, ordering, on_publish, recorded_by)
			VALUES (true, $1, $2, $3) ON CONFLICT (singleton) DO NOTHING`, want.Ordering, string(want.OnPublish), by)
		if err != nil {
			return RecordedSettings{}, false, settingsErr(s.table, "record", err)
		}
		recorded = tag.RowsAffected() == 1
		if rec, found, err = ReadSettings(ctx, s.pool, s.table); err != nil {
			return RecordedSettings{}, false, err
		}
		if !found {
			return RecordedSettings{}, false, fmt.Errorf("record settings of %s: the record vanished after it was written; is something deleting from %s?", s.table.Qualified(), SettingsTable(s.table))
		}
	}
	var differ, why []string
	if rec.Ordering != want.Ordering {
		differ = append(differ, fmt.Sprintf("--ordering: the table's is %s, this instance's %s", rec.Ordering, want.Ordering))
		why = append(why, "an instance without --ordering aggregate publishes a held aggregate's later rows before its earlier one (G12)")
	}
	if rec.OnPublish != want.OnPublish {
		differ = append(differ, fmt.Sprintf("--on-publish: the table's is %s, this instance's %s", rec.OnPublish, want.OnPublish))
		why = append(why, "with two policies what the table keeps of a published row depends on which instance published it")
	}
	if len(differ) > 0 {
		return rec, false, fmt.Errorf("%w %s: %s (recorded by %s at %s). Every instance of a table runs with the same --ordering and --on-publish: %s. "+
			"Start this instance with %s; or, to change the table's settings, stop every instance, run `outbox-relay migrate --record-settings %s` "+
			"with the same --database-url and --table, and start every instance with the new flags (docs/upgrading.md, \"Changing --ordering or --on-publish\")",
			ErrSettingsDiffer, s.table.Qualified(), strings.Join(differ, "; "), termsafe.String(rec.RecordedBy), rec.RecordedAt.UTC().Format(time.RFC3339),
			strings.Join(why, "; "), rec.Flags(), want.Flags())
	}
	return rec, recorded, nil
}

// settingsErr says what to do about a failure on <table>_settings.
func settingsErr(t Table, what string, err error) error {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		switch pgErr.Code {
		case sqlstateUndefinedTable:
			return fmt.Errorf("%w: %s (the table's recorded --ordering and --on-publish, added in migration 0009): run `outbox-relay migrate` with the same --database-url and --table",
				ErrTableMissing, SettingsTable(t))
		case sqlstateInsufficientPrivilege:
			return fmt.Errorf("%s settings of %s: %w: GRANT SELECT, INSERT ON %s TO the relay's role (outbox-relay migrate --print-grants prints every grant)",
				what, t.Qualified(), err, SettingsTable(t))
		}
	}
	return fmt.Errorf("%s settings of %s in %s: %w", what, t.Qualified(), SettingsTable(t), err)
}
