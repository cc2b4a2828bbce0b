package schema

import (
	"bytes"
	"fmt"
	"strings"
	"text/template"

	"github.com/jackc/pgx/v5"

	outboxsql "github.com/outbox-relay/outbox-relay/sql"
)

// Roles names the roles of the least-privilege script.
type Roles struct {
	Relay, Producer, Operator string
}

type grantsData struct {
	templateData
	r Roles
}

func (d grantsData) Relay() string       { return pgx.Identifier{d.r.Relay}.Sanitize() }
func (d grantsData) Producer() string    { return pgx.Identifier{d.r.Producer}.Sanitize() }
func (d grantsData) Operator() string    { return pgx.Identifier{d.r.Operator}.Sanitize() }
func (d grantsData) RelayLit() string    { return Literal(d.r.Relay) }
func (d grantsData) ProducerLit() string { return Literal(d.r.Producer) }
func (d grantsData) OperatorLit() string { return Literal(d.r.Operator) }

// Literal quotes s as an SQL string literal (standard_conforming_strings).
func Literal(s string) string { return "'" + strings.ReplaceAll(s, "'", "''") + "'" }

// Grants renders sql/roles.sql for table t: CREATE ROLE (when missing) and
// the grants each role needs, every identifier quoted.
func Grants(t Table, r Roles) (string, error) {
	for _, n := range []struct{ flag, v string }{{"--relay-role", r.Relay}, {"--producer-role", r.Producer}, {"--operator-role", r.Operator}} {
		if n.v == "" || len(n.v) > 63 || strings.ContainsAny(n.v, "\x00$") {
			return "", fmt.Errorf("%s %q: want a role name of 1 to 63 bytes without NUL or $", n.flag, n.v)
		}
	}
	tmpl, err := template.New("roles.sql").Option("missingkey=error").Parse(outboxsql.Roles)
	if err != nil {
		return "", fmt.Errorf("parse roles.sql: %w", err)
	}
	var buf bytes.Buffer
	if err := tmpl.Execute(&buf, grantsData{templateData{t: t}, r}); err != nil {
		return "", fmt.Errorf("render roles.sql: %w", err)
	}
	return buf.String(), nil
}
