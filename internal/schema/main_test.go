package schema_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

func TestMain(m *testing.M) { testenv.Main(m) }

func connect(t *testing.T, url string) *pgx.Conn {
	t.Helper()
	conn, err := pgx.Connect(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close(context.Background()) })
	return conn
}
