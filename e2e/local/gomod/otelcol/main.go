// A minimal OpenTelemetry Collector for the local test cluster: OTLP in (gRPC and HTTP),
// OTLP JSON lines out to a file (the contrib file exporter), so a test can read what was
// received. The factories are written by hand, as the collector builder (ocb) would
// generate them; every collector module is pinned to one release in go.mod.
package main

import (
	"fmt"
	"os"

	"github.com/open-telemetry/opentelemetry-collector-contrib/exporter/fileexporter"
	"go.opentelemetry.io/collector/component"
	"go.opentelemetry.io/collector/confmap"
	"go.opentelemetry.io/collector/confmap/provider/envprovider"
	"go.opentelemetry.io/collector/confmap/provider/fileprovider"
	"go.opentelemetry.io/collector/connector"
	"go.opentelemetry.io/collector/exporter"
	"go.opentelemetry.io/collector/extension"
	"go.opentelemetry.io/collector/otelcol"
	"go.opentelemetry.io/collector/processor"
	"go.opentelemetry.io/collector/receiver"
	"go.opentelemetry.io/collector/receiver/otlpreceiver"
	"go.opentelemetry.io/collector/service/telemetry/otelconftelemetry"
)

// version is the collector release of go.mod (OTELCOL_VERSION in versions.env).
var version = "dev"

func factories() (otelcol.Factories, error) {
	receivers, err := otelcol.MakeFactoryMap[receiver.Factory](otlpreceiver.NewFactory())
	if err != nil {
		return otelcol.Factories{}, err
	}
	exporters, err := otelcol.MakeFactoryMap[exporter.Factory](fileexporter.NewFactory())
	if err != nil {
		return otelcol.Factories{}, err
	}
	return otelcol.Factories{
		Receivers:  receivers,
		Processors: map[component.Type]processor.Factory{},
		Exporters:  exporters,
		Extensions: map[component.Type]extension.Factory{},
		Connectors: map[component.Type]connector.Factory{},
		Telemetry:  otelconftelemetry.NewFactory(),
		ReceiverModules: map[component.Type]string{
			otlpreceiver.NewFactory().Type(): "go.opentelemetry.io/collector/receiver/otlpreceiver",
		},
		ExporterModules: map[component.Type]string{
			fileexporter.NewFactory().Type(): "github.com/open-telemetry/opentelemetry-collector-contrib/exporter/fileexporter",
		},
	}, nil
}

func main() {
	settings := otelcol.CollectorSettings{
		BuildInfo: component.BuildInfo{
			Command:     "otelcol",
			Description: "pdcluster's local OpenTelemetry Collector (OTLP receiver, file exporter)",
			Version:     version,
		},
		Factories: factories,
		ConfigProviderSettings: otelcol.ConfigProviderSettings{
			ResolverSettings: confmap.ResolverSettings{
				// --config=FILE reads a file; ${VAR} (and ${env:VAR}) in it read the environment.
				ProviderFactories: []confmap.ProviderFactory{envprovider.NewFactory(), fileprovider.NewFactory()},
				DefaultScheme:     "env",
			},
		},
		ProviderModules: map[string]string{
			"env":  "go.opentelemetry.io/collector/confmap/provider/envprovider",
			"file": "go.opentelemetry.io/collector/confmap/provider/fileprovider",
		},
	}
	if err := otelcol.NewCommand(settings).Execute(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
