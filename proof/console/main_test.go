package console_test

import (
	"testing"

	"github.com/outbox-relay/outbox-relay/internal/console/consoletest"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// The console's fixture is the product's own (internal/console/consoletest).

func TestMain(m *testing.M) { testenv.Main(m) }

const token = consoletest.Token

type row = consoletest.Row

var (
	setup = consoletest.Setup
	enc   = consoletest.Enc
)
